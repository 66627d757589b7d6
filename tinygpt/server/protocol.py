"""What goes over the wire: the server's limits, its error (OpenAI's {"error": {...}} body), the
request bodies the endpoints validate against, and the response shapes /openapi.json publishes.

The request models are the real ones: an endpoint parses its body with exactly the class named
here (checks.validate). The response models only describe: responses.py and routes.py build
plain dicts, byte for byte what OpenAI's and vLLM's clients read, and these classes tell a
client generator or an API fuzzer what those dicts hold.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MODEL_ID = "tinygpt"
KV_POOL_BYTES = 256 * 2**20          # the default KV pool's ceiling (see cli.default_kv_blocks)
MAX_BODY_BYTES = 1024 * 1024         # --max-body-bytes default
BODY_TIMEOUT_S = 30.0                # --body-timeout default
HEADER_TIMEOUT_S = 10.0              # --header-timeout default
KEEP_ALIVE_S = 5                     # idle keep-alive connections are closed after this
MAX_STOP_CHARS = 1024                # all stop strings together, in characters
MAX_N = 16                           # choices per prompt
MAX_CHOICES = 64                     # choices per request (prompts times n)
MAX_LOGPROBS = 20                    # top alternatives per token
MAX_ECHO_ENTRIES = 2**18             # echoed prompt tokens x (logprobs + 1), over all choices
COMPLETION_MAX_TOKENS = 16           # /v1/completions' default max_tokens (OpenAI's legacy one)
MAX_SEED = 2**63 - 1
RETRY_AFTER_S = 1                    # the 429's Retry-After
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")   # a chat message's roles
CHAT_ROLES = {"developer": "system"}   # OpenAI roles renamed for the chat template


class APIError(Exception):
    """An error answered as OpenAI does: status code and an {"error": {...}} body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                      kind, code)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# ----------------------------------------------------------------------------------------------
# request bodies: unknown fields are kept (extra="allow") so that checks.check_common can name
# them in its 400 (at the top level, and inside response_format, structured_outputs, tools and
# tool_choice: checks.held_to_fields), and published as refused (additionalProperties: false),
# which they are. Chat messages, their parts and their tool calls are the exception (_MESSAGE):
# clients resend an assistant reply with the keys they got it with (the openai SDK: refusal,
# annotations, audio, function_call), so their unknown keys are accepted, ignored, and published
# as allowed. NaN and Infinity are not JSON (checks.parse_json: 400); a number with a fraction or
# an exponent too large for a double parses to infinity, which a number field refuses
# (allow_inf_nan=False: a 422) and an object field (metadata, a schema) keeps. Strict: a value of
# another JSON type is a 422, never converted ("5" is not max_tokens 5, false is not token id 0;
# an integer is still a number)

_BODY = ConfigDict(extra="allow", allow_inf_nan=False, strict=True,
                   json_schema_extra={"additionalProperties": False})
_MESSAGE = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class JsonSchemaSpec(BaseModel):
    """response_format's json_schema: the schema the reply must be valid under."""

    model_config = _BODY
    name: str
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema"}."""

    model_config = _BODY
    type: str
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar
    (llguidance's Lark dialect) and json_object."""

    model_config = _BODY
    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class Common(BaseModel):
    """The fields both generation endpoints take (OpenAI's, and vLLM's top_k, min_p and
    ignore_eos)."""

    model_config = _BODY
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    best_of: int | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict | None = None
    ignore_eos: bool | None = False


class CompletionRequest(Common):
    """POST /v1/completions: a prompt as text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: bool | int | None = None       # false: none (a no-op some clients send)
    suffix: str | None = None


class Part(BaseModel):
    """One part of a message's content; only {"type": "text"} parts are implemented."""

    model_config = _MESSAGE
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _MESSAGE
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant turn made: its arguments are a JSON text, as OpenAI sends them."""

    model_config = _MESSAGE
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(BaseModel):
    """One turn of a conversation (checks.check_message holds it to OpenAI's rules: a role of
    MESSAGE_ROLES, content unless an assistant turn makes calls, a tool turn's tool_call_id)."""

    model_config = _MESSAGE
    role: str
    content: str | list[Part] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


class FunctionDef(BaseModel):
    model_config = _BODY
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """A function the model may call (OpenAI's {"type": "function", "function": {...}})."""

    model_config = _BODY
    type: str
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _BODY
    name: str


class ToolChoice(BaseModel):
    """tool_choice naming one function: {"type": "function", "function": {"name"}}."""

    model_config = _BODY
    type: str
    function: NamedFunction


class ChatCompletionRequest(Common):
    """POST /v1/chat/completions: messages through the model's chat template."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): exactly one of prompt and messages."""

    model_config = ConfigDict(**{**_BODY, "json_schema_extra": {
        "additionalProperties": False,
        "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]}})
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = _BODY
    model: str | None = None
    tokens: list[int]


REQUESTS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


# ----------------------------------------------------------------------------------------------
# response shapes (published, not used to build the responses)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: 400, 404, 408, 413, 422, 429 (with Retry-After), 500, 503."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """The whole completion; with stream: true the body is server-sent events instead, each a
    chunk of this shape, then "data: [DONE]"."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(BaseModel):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """The whole reply; with stream: true, server-sent "chat.completion.chunk" events whose
    choices carry a delta, then "data: [DONE]"."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]
