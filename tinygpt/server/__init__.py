"""`python -m tinygpt serve`: an OpenAI-compatible HTTP server over a tinygpt engine.

    python -m tinygpt serve --port 8000          # the shipped checkpoint on 127.0.0.1:8000

    POST /v1/completions       prompt (text, token ids, or a list of either) -> text; stream:
                               true sends server-sent events, then "data: [DONE]"; as Hugging
                               Face's tokenizer and vLLM do, a text prompt's special-token
                               names ("<|im_start|>") are read as their ids (chat messages'
                               content stays text)
    POST /v1/chat/completions  messages -> the assistant's reply, through the chat template
    GET  /v1/models            the one model, under its own id ("tinygpt",
                               "SmolLM2-135M-Instruct"); /v1/models/{id} alone
    POST /tokenize             vLLM's: {"prompt"} or {"messages"} -> {"count", "max_model_len",
                               "tokens", "token_strs"}; as vLLM's, it reads the names of
                               special tokens ("<|endoftext|>") as their ids, and
                               add_special_tokens (default true for a prompt, false for
                               messages) puts the BOS first where the tokenizer adds one
    POST /detokenize           vLLM's: {"tokens"} -> {"prompt"}
    GET  /tokenizer_info       the tokenizer's special tokens (eos, bos, pad), vocabulary size,
                               context and chat template (a Jinja2 string, when it has one)
    GET  /health               {"status": "ok", ...engine counts}
    GET  /metrics              Prometheus text: requests, tokens, running / waiting, TTFT, ITL,
                               the KV pool and the prefix cache

Requests. Both endpoints take the OpenAI fields model, max_tokens (chat: also
max_completion_tokens), temperature, top_p, seed, stop, presence_penalty, frequency_penalty,
n, stream, stream_options.include_usage, and vLLM's top_k, min_p and ignore_eos.
/v1/completions also takes echo (the prompt is returned before the completion) and logprobs
(an int k: each token's log-probability and its k most likely alternatives; with echo, the
prompt's tokens too; max_tokens 0 with echo scores the prompt alone, generating nothing);
/v1/chat/completions takes logprobs (true / false) and top_logprobs.
Log-probabilities are the log-softmax of the model's raw logits, before temperature,
penalties and filters (vLLM's default), so they do not depend on the sampling knobs. A list
of prompts gives a choice per prompt; n > 1 gives n choices per prompt, and with a seed the
i-th choice of each prompt samples with seed + i. Message content is a string or a list of
{"type": "text"} parts (joined with newlines); the "developer" role is the system role.

Structured outputs. response_format {"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema"}} and vLLM's structured_outputs (json, regex, choice,
grammar, json_object) hold the reply to a grammar (structured.py over tinygpt.structured);
tools with tool_choice none / auto / required / a named function, calls written and read in
the format of tools.py, come back as message.tool_calls with finish_reason "tool_calls"
(streamed: each call's id and name, then its arguments); "auto" answers in text or in calls,
a call it begins held to the tools' schemas; calls cut by max_tokens come back as the calls
begun with finish_reason "length". Fields that change nothing here are
accepted (user, store, metadata, logprobs: false, response_format {"type": "text"}); fields
that would change the output and are not implemented (logit_bias, suffix, ...) are a 400, and
so is an unknown field, at the top level or inside response_format (and its json_schema),
structured_outputs, a tool (and its function) or tool_choice, named by its path
("structured_outputs.whitespace_pattern"). Chat messages are the exception: clients resend an
assistant reply with the keys they got (refusal, annotations, audio, ...), so a message's
unknown keys are ignored.

Limits. A body over --max-body-bytes is a 413; a body that does not arrive within
--body-timeout seconds a 408; a prompt too long for the context is refused from its length in
characters before it is tokenized whenever no tokenization could make it fit; stop strings
may total MAX_STOP_CHARS characters. JSON parsing, validation, tokenization and the chat
template run on a thread pool, not on the event loop, so a large request never stalls the
streams of the others (parsing still holds Python's GIL while it runs, which the body limit
bounds: a megabyte of token ids parses in well under 100 ms (AVX-512 EPYC, 2026-11-25); lists
longer than any valid request are refused before they are validated item by item). uvicorn
closes idle keep-alive connections after 5 s and connections whose request headers have not
arrived after --header-timeout seconds.

Errors. Every error is an OpenAI-style JSON body {"error": {"message", "type", "param",
"code"}}: 400 for malformed JSON (lone surrogates, NaN and integers of more than 4300 digits
included), values out of range, unsupported fields and prompts or max_tokens that do not fit
the context; 422 for a body that is not a JSON object, a required field missing or a field of
the wrong type (a number with a fraction or an exponent too large for a double, which parses to
infinity, included; inside an object field, metadata or a schema, it is kept as it is); 404 for
an unknown model or path; 413, 408; 429 (with Retry-After) when the engine's queue is full; 503
while shutting down. Streaming requests are checked whole before the 200 and the first event. A
bad request never disturbs the others. A streaming client that disconnects has its request
cancelled at once. On SIGTERM uvicorn stops accepting connections, running requests get
`--grace` seconds to finish, and the rest are cancelled.

The engine (tinygpt/engine.py) is AsyncEngine by default: continuous batching on a paged KV
cache (--max-running, --token-budget, --kv-blocks) with automatic prefix caching: full KV
blocks of earlier requests stay in the pool, found again by a key chained over their tokens,
so a conversation that resends its history, or requests that share a system prompt, prefill
only what is new (--no-prefix-caching turns it off; /metrics gives the cached blocks and the
hit rate). `--engine serial` serves one request at a time (the reference; no logprobs).

Where things live (imports run down this list, never up):
    protocol.py    limits, APIError, the request models and the published response shapes
    checks.py      the body as JSON and as its model; the fields every request shares
    tools.py       the tool-call format: tools in the prompt, calls written and read back
    structured.py  the reply's shape: response_format, structured_outputs, tools -> a grammar
    prompts.py     text, chats and ids to checked token ids; a request to a Job; /tokenize
    responses.py   engine events to OpenAI's responses, whole or as server-sent events
    metrics.py     the Prometheus registry over the engine
    limits.py      the HTTP limits: body size and arrival time, the header timer
    openapi.py     /openapi.json with the real request bodies, and /docs served offline
    routes.py      the endpoints, each handing the work on
    app.py         create_app: the rooms wired into one FastAPI app
    cli.py         the flags and main (uvicorn)
"""

from tinygpt.server.cli import QUANTIZE, build_parser, default_kv_blocks, main
from tinygpt.server.protocol import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_CHARS,
    MODEL_ID,
    APIError,
)

__all__ = ["BODY_TIMEOUT_S", "HEADER_TIMEOUT_S", "KEEP_ALIVE_S", "MAX_BODY_BYTES", "MAX_CHOICES",
           "MAX_LOGPROBS", "MAX_N", "MAX_SEED", "MAX_STOP_CHARS", "MODEL_ID", "QUANTIZE",
           "APIError", "build_parser", "create_app", "default_kv_blocks", "main"]


def __getattr__(name: str):
    # create_app loads FastAPI and the engine (torch); `python -m tinygpt serve --help` and
    # argparse's errors for malformed flags need neither, so the app module loads on first
    # use of its name (cli.main checks the flags' ranges after torch loads)
    if name == "create_app":
        from tinygpt.server.app import create_app

        return create_app
    raise AttributeError(f"module 'tinygpt.server' has no attribute {name!r}")
