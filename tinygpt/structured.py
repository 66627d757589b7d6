"""Day 19, in production: structured outputs with a real grammar engine behind the sampler.

tinygpt.constrained is the teaching version: a regular-expression subset compiled to a DFA and
walked over the vocabulary. A server needs all of JSON Schema (nesting, $ref, anyOf, bounds),
tool calls and grammars, compiled in milliseconds and masked in tens of microseconds per token.
This module puts llguidance (an Earley parser over a lazily built lexer; chosen against
XGrammar and outlines-core by measurement, see tinygpt.bench.grammars and the README) behind
the constraint interface that tinygpt.generate.stream and the engines take:

    grammars = Grammars(tokenizer, vocab_size)       # once per served model
    grammar = grammars.json_schema(schema)           # compiled once per schema, then cached
    constraint = grammar.constraint(eos_ids=(2,))    # one per request
    generate(model, prompt, params, eos_id=2, constraint=constraint)

A constraint masks each step's logits with the tokens the grammar allows next (the end-of-text
ids only once the text so far is complete) and advances with the token chosen, so the text
always parses, and once the grammar is complete only the end can follow. Errors in what a
client sends (a schema that is not JSON Schema, a pattern that is not a regex, a grammar past
the limits) raise GrammarError with the first line of the engine's message, which the server
answers with a 400. The compile also takes the first step every request will take (the first
mask, then a token it allows), so that a grammar that compiles but cannot begin a reply (a
$ref cycle, a regex too large for the lexer) is a GrammarError there, before any request runs;
a failed compile is cached as a good one is.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from tinygpt.sampling import check_token_id

MAX_GRAMMAR_CHARS = 200_000      # a schema, regex or grammar's text; more is a GrammarError
CACHED_GRAMMARS = 256            # compiled grammars kept (least recently used goes first)
MAX_ERROR_CHARS = 200            # of the engine's message in a GrammarError (its first line)
# JSON as the constraint writes it: one space after ":" and ",", no other whitespace, so the
# model cannot pad forever and runs of forced tokens (keys, punctuation) are long
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """What a client sent cannot be compiled (the grammar engine's message says why)."""


def engine_error(message: str) -> str:
    """The first line of the grammar engine's error, at most MAX_ERROR_CHARS long: the rest
    is a dump of the parser's state and the grammar, for the engine's developers."""
    first = next((line for line in message.splitlines() if line.strip()), "unknown error")
    return first if len(first) <= MAX_ERROR_CHARS else first[:MAX_ERROR_CHARS - 3] + "..."


class _Vocabulary:
    """A tinygpt tokenizer (token_bytes, special_tokens, encode) as llguidance's
    TokenizerWrapper reads one. Special tokens get a 0xFF byte first, which no UTF-8 text
    holds, so grammar text can never spell one."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int) -> None:
        specials = set(getattr(tokenizer, "special_tokens", {}).values())
        known = tokenizer.vocab_size
        self.tokens = [b"\xff" + bytes(f"<unused_{i}>", "ascii") if i >= known else
                       (b"\xff" if i in specials else b"") + tokenizer.token_bytes([i])[0]
                       for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in specials if i < vocab_size)
        self.eos_token_id, self.bos_token_id = eos_id, getattr(tokenizer, "bos_id", None)
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class Grammar:
    """A compiled grammar: hands out a fresh constraint per request."""

    def __init__(self, key: str, matcher, vocab_size: int, engine_eos: int) -> None:
        self.key, self._matcher, self.vocab_size = key, matcher, vocab_size
        self.engine_eos = engine_eos      # the end-of-text id the grammar engine was given

    def constraint(self, eos_ids: Sequence[int]) -> GrammarConstraint:
        """A constraint for one request that ends with any of eos_ids."""
        return GrammarConstraint(self._matcher.deep_copy(), self.vocab_size, eos_ids,
                                 self.engine_eos)


class GrammarConstraint:
    """One request's grammar state: mask(logits) and advance(token), as
    tinygpt.generate.stream takes a constraint. The grammar engine allows its own end-of-text
    id (engine_eos: the one Grammars gave it) once the text is complete; a request that ends
    on other ids (a chat's end-of-turn) must not get it, or the model could write it as text,
    so only eos_ids are ever allowed to end."""

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int],
                 engine_eos: int | None = None) -> None:
        # llguidance.numpy, not llguidance.torch: the same fill, and importing the latter
        # compiles a helper with torch.compile, which loads torch's compiler stack (6-8 s on
        # the 2-core AVX2 EPYC, 2026-11-28) in every server start for nothing we use
        import llguidance.numpy

        self.matcher, self.vocab_size = matcher, vocab_size
        self.eos_ids = tuple(eos_ids)
        if not self.eos_ids:
            raise ValueError("eos_ids: a constrained request needs an end-of-text id to end on")
        for i, eos in enumerate(self.eos_ids):
            check_token_id(f"eos_ids[{i}]", eos, vocab_size)
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._words = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.from_numpy(self._words)     # the same memory, read as a tensor
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._not_ends = [] if engine_eos is None or engine_eos in self.eos_ids else [engine_eos]
        self.finished = False

    def allowed(self) -> torch.Tensor:
        """(vocab_size,) bool: the tokens that may come next."""
        self._fill(self.matcher, self._words, 0)
        if self.matcher.is_error():
            raise GrammarError(engine_error(self.matcher.get_error()))
        bits = (self._bits[0, :, None] >> self._shifts) & 1
        allowed = bits.reshape(-1)[:self.vocab_size].bool()
        ends = self.matcher.is_accepting()
        if self._not_ends:                      # the engine's end, when not this request's
            allowed[self._not_ends] = False
        allowed[list(self.eos_ids)] = ends      # only this request's ends, and only when done
        return allowed

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token_id: int) -> None:
        check_token_id("token_id", token_id, self.vocab_size)
        if token_id in self.eos_ids:
            self.finished = True
            return
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not continue the grammar: "
                               f"{engine_error(self.matcher.get_error())}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows and no other (llguidance's fast-forward)."""
        return list(self.matcher.compute_ff_tokens())


class Grammars:
    """Grammars for one tokenizer (a tinygpt tokenizer: token_bytes, special_tokens, encode;
    or tinygpt.hf_tokenizer.HFTokenizer), compiled on demand and cached by their text, a grammar
    that cannot be used with its GrammarError (thread-safe: the server compiles on its worker
    threads, never on the event loop or the engine's). `compiled` counts the compiles run."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int | None = None, *,
                 cached: int = CACHED_GRAMMARS) -> None:
        import llguidance

        if eos_id is None:
            specials = getattr(tokenizer, "special_tokens", {})
            eos_id = specials.get("<|endoftext|>", specials.get("<|im_end|>", 0))
        self._llg = llguidance
        self.vocab_size = vocab_size
        hf = getattr(tokenizer, "tokenizer", None)        # tinygpt.hf_tokenizer.HFTokenizer's
        if hf is not None and hasattr(hf, "convert_ids_to_tokens"):
            import llguidance.hf

            self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
        else:
            self.tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size, eos_id)),
                n_vocab=vocab_size)
        # short errors: without this, each message carries the parser's state and the grammar
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, Grammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self.cached, self.compiled = cached, 0
        # the engine indexes the vocabulary on its first matcher (0.7 s for SmolLM2's 49,152
        # tokens on the AVX-512 EPYC, 2026-11-27): pay that here, once, not in the first
        # request
        self._compile("warm-up", lambda: self._llg.LLMatcher.grammar_from_regex("a"))

    # -- what can be asked for -----------------------------------------------------------------

    def json_schema(self, schema: dict | bool) -> Grammar:
        """Text that is one JSON value valid under `schema` (a JSON Schema: a dict, or True for
        any value as {} is; False admits no value and is a GrammarError)."""
        if schema is True:                 # llguidance takes only objects
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema: a JSON Schema is a dict or True (False admits no "
                               f"value), got {schema!r:.60}")
        text = json.dumps(schema)         # (key order kept: properties come out in order)
        return self._get("json", text, lambda: self._llg.LLMatcher.grammar_from_json_schema(
            text, defaults=JSON_STYLE))

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return self.json_schema({"type": "object"})

    def regex(self, pattern: str) -> Grammar:
        """Text that matches `pattern` whole."""
        if not isinstance(pattern, str):
            raise GrammarError(f"regex: the pattern must be a str, got {type(pattern).__name__}")
        return self._get("regex", pattern,
                         lambda: self._llg.LLMatcher.grammar_from_regex(pattern))

    def choice(self, options: Sequence[str]) -> Grammar:
        """Exactly one of `options` (a list of strings; a str alone is refused, not read as
        its characters)."""
        if isinstance(options, str) or not options or not all(isinstance(o, str)
                                                              for o in options):
            raise GrammarError(f"choice: give a non-empty list of strings, got {options!r:.60}")
        return self.lark("start: " + " | ".join(json.dumps(o) for o in options))

    def lark(self, grammar: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (which can embed %json {schema})."""
        return self._get("lark", grammar, lambda: self._llg.LLMatcher.grammar_from_lark(
            grammar))

    # -- the cache -------------------------------------------------------------------------

    def _get(self, kind: str, text: str, build) -> Grammar:
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar's text has {len(text):,} characters; at most "
                               f"{MAX_GRAMMAR_CHARS:,}")
        key = f"{kind}:{text}"
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
        if grammar is None:
            try:
                grammar = self._compile(key, build)
            except GrammarError as err:  # kept too: asking again costs no second compile
                grammar = err
            with self._lock:
                self._cache[key] = grammar
                self.compiled += 1
                while len(self._cache) > self.cached:
                    self._cache.popitem(last=False)
        if isinstance(grammar, GrammarError):
            raise GrammarError(str(grammar))
        return grammar

    def _compile(self, key: str, build) -> Grammar:
        try:
            text = build()
        except ValueError as err:        # not JSON, not a schema, not a regex ...
            raise GrammarError(engine_error(str(err))) from None
        matcher = self._llg.LLMatcher(self.tokenizer, text, log_level=0, limits=self._limits)
        if matcher.is_error():           # the constructor never raises: it sets an error
            raise GrammarError(engine_error(matcher.get_error()))
        grammar = Grammar(key, matcher, self.vocab_size, self.tokenizer.eos_token)
        self._first_step(grammar)
        return grammar

    def _first_step(self, grammar: Grammar) -> None:
        """Take the first step every request with `grammar` will take, so that a grammar the
        engine cannot begin is a GrammarError here and not a failed request: the first mask,
        then, on a copy, the first token it allows and the mask after that. Some grammars
        compile and fail only there: a $ref cycle or a rule that never ends admits no text
        ("NoExtensionBias"); a{1000000} runs the lexer out of fuel at its first token. The
        first mask is computed on the compiled matcher itself, so each request's copy starts
        from it (paid once): computed on a throwaway copy, it could use up lexer fuel that the
        copies share and leave the next copy's first mask to fail (a{1000000}'s did)."""
        eos = (self.tokenizer.eos_token,)
        try:
            allowed = GrammarConstraint(grammar._matcher, self.vocab_size, eos,
                                        grammar.engine_eos).allowed()
            allowed[list(eos)] = False
            tokens = allowed.nonzero()
            if len(tokens):
                probe = grammar.constraint(eos)
                if not probe.matcher.consume_token(int(tokens[0])):
                    raise GrammarError(engine_error(probe.matcher.get_error()))
                probe.allowed()
        except GrammarError as err:
            why = " (no text matches it)" if str(err) == "NoExtensionBias" else ""
            raise GrammarError(f"the engine cannot begin a reply with it{why}: {err}") from None
