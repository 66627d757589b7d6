"""From a request's text to the token ids the engine takes: the served model's side of every
endpoint. Prompts holds the tokenizer, the context and the ids that end a reply; it turns a
chat conversation (through the chat template), a text prompt or token ids into checked ids,
and a whole generation request into a Job, one entry per choice. The tokenizer endpoints
(/tokenize, /detokenize, /tokenizer_info: vLLM's shapes) read and answer through it too.

prepare, tokenize and detokenize (parsing, the checks, the chat template, tokenization) run on
the server's thread pool, never on the event loop. On the loop run info() (routes.py answers
/tokenizer_info with it) and the decodes responses.py makes as it streams a reply: token_text
for the tokens of its logprobs, and the tokenizer's decode of a prompt given as ids (for echo
and for logprobs' text_offset); a whole reply is built, decodes included, on a worker thread."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from tinygpt.server.checks import (
    bound_echo,
    bounded,
    check_common,
    check_message,
    check_model,
    fit_context,
    parse_json,
    sampling_params,
    too_long,
    validate,
)
from tinygpt.server.protocol import (
    CHAT_ROLES,
    COMPLETION_MAX_TOKENS,
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tinygpt.server.structured import reply_shape
from tinygpt.server.tools import assistant_text, tool_result_text, with_tools


@dataclass
class Job:
    """A checked request, ready for the engine: one entry per choice."""

    chat: bool
    prompts: list[list[int]]          # per prompt
    texts: list[str | None]           # per prompt: its text (completions' echo), if it had one
    params: list                      # per choice (prompt-major): SamplingParams
    prompt_of: list[int]              # per choice: its prompt's index
    eos: list[int]
    logprobs: int | None              # top alternatives per generated token (None: none)
    echo: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool            # usage so far in every chunk (vLLM's extension)
    score_only: bool = False          # max_tokens 0 with echo: the prompt and its logprobs only
    grammar: object = None            # tinygpt.structured.Grammar the reply is held to, if any
    reads: str = "text"               # "tools": text or calls ("auto"); "calls": calls only
    call_name: str | None = None      # the function every call names, when only one can be
    grammar_param: str | None = None  # the field that asked for the grammar


def max_token_chars(tokenizer, vocab_size: int) -> int:
    """The most characters one token's text can hold (special tokens' names included): a
    text of more than (context - 1) times this many characters can never fit the context."""
    longest = 1
    for i in range(vocab_size):
        try:
            longest = max(longest, len(tokenizer.decode([i])))
        except Exception:  # noqa: BLE001 (an id without text of its own)
            continue
    return longest


class Prompts:
    """The served model's text side. tokenizer: encode, decode, encode_chat, special_tokens;
    context: the model's max_seq_len; vocab: its vocabulary size. eos_ids end a completion,
    end_of_turn_ids a chat reply (default: the tokenizer's "<|endoftext|>", and "<|end|>" then
    it; see tinygpt.loading.ModelInfo). grammars: the tinygpt.structured.Grammars replies are
    held to, or why there are none (structured outputs, tool_choice "required" and a named
    tool_choice are then a 400 saying so). max_positions: the most positions one request may
    take in the engine's KV pool (default: the context). max_model_len, the smaller of the
    two, is what a request's prompt and max_tokens must fit (a chat reply without max_tokens
    stops there), and what /v1/models and /tokenize report."""

    def __init__(self, tokenizer, context: int, vocab: int, model_id: str, eos_ids=None,
                 end_of_turn_ids=None, grammars="not set up",
                 max_positions: int | None = None) -> None:
        self.tokenizer, self.context, self.vocab, self.model_id = (tokenizer, context, vocab,
                                                                   model_id)
        self.specials = getattr(tokenizer, "special_tokens", {})
        self.eos = ([self.specials[t] for t in ("<|endoftext|>",) if t in self.specials]
                    if eos_ids is None else list(eos_ids))
        self.end_of_turn = ([self.specials[t] for t in ("<|end|>",) if t in self.specials]
                            + self.eos if end_of_turn_ids is None else list(end_of_turn_ids))
        self.bos_id = getattr(tokenizer, "bos_id", None)
        # a BOS the tokenizer puts before a text (GGUF's tokenizer.ggml.add_bos_token); the chat
        # template writes its own markers, and token-id prompts are taken as they are
        self.bos_prefix = ([self.bos_id] if self.bos_id is not None
                           and getattr(tokenizer, "add_bos", False) else [])
        self.chars_per_token = max_token_chars(tokenizer, vocab)
        self.grammars = grammars     # tinygpt.structured.Grammars, or why there are none
        self.max_positions = context if max_positions is None else max_positions
        self.max_model_len = min(context, self.max_positions)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- text, conversations and ids to checked ids ------------------------------------------

    def chat_ids(self, messages, tools: list | None = None) -> tuple[list[int], int]:
        """Token ids of the conversation through the chat template (+ the assistant's turn),
        and its characters; tools, earlier calls and their results are written in
        tinygpt.server.tools' format. APIError 400 for a message OpenAI refuses
        (checks.check_message) and for what the template cannot render."""
        turns = []
        for i, message in enumerate(messages):
            check_message(i, message)
            content = message.content
            if isinstance(content, list):
                kinds = sorted({part.type for part in content} - {"text"})
                if kinds:
                    raise APIError(400, f"messages[{i}].content: only text parts are "
                                        f"implemented, got {kinds}", param="messages")
                content = "\n".join(part.text for part in content)
            role = message.role
            if message.tool_calls:
                if role != "assistant":
                    raise APIError(400, f"messages[{i}].tool_calls: only an assistant turn "
                                        f"makes calls", param="messages")
                content = assistant_text(content or "", [call.model_dump()    # None: calls only
                                                         for call in message.tool_calls])
            elif role == "tool":
                role, content = "user", tool_result_text(content, message.tool_call_id)
            turns.append({"role": CHAT_ROLES.get(role, role), "content": content})
        # each character once: the tools' text joins the first turn, a system turn's own text
        # included, so the count is taken from the turns as the template gets them
        turns = with_tools(turns, [tool.model_dump() for tool in tools] if tools else None)
        chars = sum(len(turn["content"]) for turn in turns)
        if chars > (self.context - 1) * self.chars_per_token:
            raise APIError(400, f"messages hold {chars} characters; no tokenization of them "
                                f"fits the model's context of {self.context} tokens",
                           param="messages", code="context_length_exceeded")
        try:
            return self.tokenizer.encode_chat(turns), chars
        except (TypeError, ValueError, KeyError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from None

    def text_ids(self, text: str, param: str = "prompt", specials: bool = False) -> list[int]:
        """A text's ids; specials: special-token names ("<|im_start|>") read as their ids."""
        context = self.context
        if len(text) > (context - 1) * self.chars_per_token:
            raise APIError(400, f"{param}: {len(text)} characters; no tokenization of them fits "
                                f"the model's context of {context} tokens", param=param,
                           code="context_length_exceeded")
        encode = self.tokenizer.encode
        try:
            if specials and "allowed_special" in inspect.signature(encode).parameters:
                return encode(text, allowed_special="all")
            return encode(text)
        except (TypeError, ValueError) as err:
            raise APIError(400, f"{param}: {err}", param=param) from None

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        if len(ids) >= self.context:
            raise APIError(400, f"{param}: {len(ids)} tokens; the model's context is "
                                f"{self.context}", param=param, code="context_length_exceeded")
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise APIError(400, f"{param}: token ids must be in [0, {self.vocab}), got "
                                f"{bad[:5]}", param=param)
        return ids

    def completion_prompts(self, prompt) -> tuple[list[list[int]], list[str | None]]:
        """/v1/completions' prompt (a text, ids, or a list of either) as ids, and each one's
        text when it had one (for echo)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_CHOICES:
            raise APIError(400, f"prompt: {len(prompt)} prompts; at most {MAX_CHOICES}",
                           param="prompt")
        ids, texts = [], []
        for i, item in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                ids.append(self.bos_prefix + self.text_ids(item, where, specials=True))
                texts.append(item)
            else:
                ids.append(self.check_ids(list(item), where))
                texts.append(None)
        return ids, texts

    # -- a generation request to a Job ---------------------------------------------------------

    def prepare(self, raw: bytes, chat: bool) -> Job:
        """Everything before the engine, on the thread pool: parse, check, tokenize."""
        context = self.context
        data = parse_json(raw)
        too_long(data, context)
        body = validate(ChatCompletionRequest if chat else CompletionRequest, data)
        check_common(body, chat, self.model_id)
        shape = reply_shape(self.grammars, body, chat)
        if body.ignore_eos and shape.grammar is not None:
            raise APIError(400, f"ignore_eos: a reply held to a grammar ({shape.param}) ends on "
                                f"the end-of-text token once the grammar is complete, which "
                                f"ignore_eos takes away; give one of ignore_eos and "
                                f"{shape.param}", param="ignore_eos")
        score_only = False
        if chat:
            ids, _ = self.chat_ids(body.messages, shape.tools)
            prompts, texts = [ids], [None]
            for name in ("max_completion_tokens", "max_tokens"):
                if getattr(body, name) is not None:
                    bounded(name, getattr(body, name), 1, context)
            name = "max_completion_tokens" if body.max_completion_tokens is not None else \
                "max_tokens"
            asked, param, default = getattr(body, name), name, None
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            echo = False
            stop_ids = self.end_of_turn
        else:
            prompts, texts = self.completion_prompts(body.prompt)
            asked, param, default = body.max_tokens, "max_tokens", COMPLETION_MAX_TOKENS
            logprobs, echo = body.logprobs, bool(body.echo)
            stop_ids = self.eos
            if asked == 0:
                if not echo:
                    raise APIError(400, "max_tokens 0 returns nothing without echo: give "
                                        "max_tokens >= 1, or echo: true to score the prompt",
                                   param="max_tokens")
                # scoring: the engine computes prompt logprobs while it generates one token,
                # which is then dropped (the OpenAI legacy API's max_tokens 0 with echo)
                asked, score_only = 1, True
        if len(prompts) * (body.n or 1) > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts times n={body.n or 1} choices; at "
                                f"most {MAX_CHOICES} choices per request", param="n")
        bound_echo([len(ids) for ids in prompts], body.n or 1, logprobs, echo)
        params, prompt_of = [], []
        for p, ids in enumerate(prompts):
            max_tokens = fit_context(len(ids), asked, context, param, default,
                                     pool=self.max_positions,
                                     prompt_param="messages" if chat else "prompt")
            for i in range(body.n or 1):
                seed = None if body.seed is None else body.seed + i
                params.append(sampling_params(body, max_tokens, seed))
                prompt_of.append(p)
        options = body.stream_options or {}
        return Job(chat, prompts, texts, params, prompt_of, [] if body.ignore_eos else stop_ids,
                   logprobs, echo, bool(body.stream), bool(options.get("include_usage")),
                   bool(options.get("include_usage") and options.get("continuous_usage_stats")),
                   score_only, shape.grammar, shape.reads, shape.call_name, shape.param)

    # -- the tokenizer endpoints (vLLM's shapes) -----------------------------------------------

    def _tokenizer_body(self, kind, raw: bytes):
        """The body of a tokenizer endpoint, validated: no unknown fields, this model."""
        body = validate(kind, parse_json(raw))
        if body.model_extra:
            raise APIError(400, f"unsupported field(s) {sorted(body.model_extra)}",
                           param=sorted(body.model_extra)[0])
        check_model(body.model, self.model_id)
        return body

    def tokenize(self, raw: bytes) -> dict:
        body = self._tokenizer_body(TokenizeRequest, raw)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        bos_prefix = self.bos_prefix
        if body.messages is not None:
            if body.add_generation_prompt is False:
                raise APIError(400, "add_generation_prompt: false is not implemented",
                               param="add_generation_prompt")
            ids, _ = self.chat_ids(body.messages)
            if body.add_special_tokens:             # vLLM's default for messages: false
                ids = bos_prefix + ids if ids[:1] != bos_prefix else ids
        else:
            ids = self.text_ids(body.prompt, specials=True)
            if body.add_special_tokens is not False:   # vLLM's default for a prompt: true
                ids = bos_prefix + ids
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": ([self.token_text(i) for i in ids] if body.return_token_strs
                               else None)}

    def detokenize(self, raw: bytes) -> dict:
        body = self._tokenizer_body(DetokenizeRequest, raw)
        bad = [i for i in body.tokens if not 0 <= i < self.vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {self.vocab}), got {bad[:5]}",
                           param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def info(self) -> dict:
        """/tokenizer_info: the end-of-text token as its text (what /tokenize reads back as
        its id: clients such as lm-evaluation-harness find its id by tokenizing it), and the
        special tokens by their own text (a tokenizer's special_token_ids when it has them,
        as a Hugging Face folder's does, else its special_tokens)."""
        tokenizer, eos, bos_id = self.tokenizer, self.eos, self.bos_id
        specials = getattr(tokenizer, "special_token_ids", self.specials)
        pad_id = getattr(tokenizer, "pad_id", None)
        template = getattr(tokenizer, "chat_template", None)
        return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": self.vocab,
                "model_max_length": self.context, "max_model_len": self.max_model_len,
                "eos_token": self.token_text(eos[0]) if eos else None,
                "eos_token_id": eos[0] if eos else None,
                "bos_token": None if bos_id is None else self.token_text(bos_id),
                "bos_token_id": bos_id, "add_bos_token": bool(self.bos_prefix),
                "pad_token": None if pad_id is None else self.token_text(pad_id),
                "special_tokens": dict(specials),
                "chat_template": template if isinstance(template, str) else None}
