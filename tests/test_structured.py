"""tinygpt.structured: llguidance grammars behind the generate loop's constraint. The oracle
for fast-forward is the same constraint with its forced() hidden (every token masked and
sampled): greedy replies must be identical token for token, with fewer masks and passes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tinygpt import load_pretrained, structured
from tinygpt.generate import generate
from tinygpt.sampling import SamplingParams
from tinygpt.structured import GrammarError, Grammars

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "colour", "count"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer = load_pretrained()
    return model.eval(), tokenizer, Grammars(tokenizer, model.cfg.vocab_size)


class Counted:
    """A constraint that counts its masks; hide=True hides forced() (no fast-forward)."""

    def __init__(self, inner, hide: bool) -> None:
        self.inner, self.masks = inner, 0
        if not hide:
            self.forced = inner.forced

    def mask(self, logits):
        self.masks += 1
        return self.inner.mask(logits)

    def advance(self, token_id):
        self.inner.advance(token_id)


def test_fast_forward_gives_the_masked_loops_tokens_with_fewer_masks(shipped):
    model, tokenizer, grammars = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    grammar = grammars.json_schema(SCHEMA)
    for prompt in ("the cat", "a dog sat on", "once upon a time"):
        runs = {}
        for hide in (True, False):
            constraint = Counted(grammar.constraint([eos]), hide)
            result = generate(model, tokenizer.encode(prompt), SamplingParams(
                temperature=0, max_new_tokens=80), eos_id=eos, tokenizer=tokenizer,
                constraint=constraint)
            runs[hide] = (result, constraint.masks)
        (plain, plain_masks), (fast, fast_masks) = runs[True], runs[False]
        assert fast.token_ids == plain.token_ids and fast.text == plain.text
        assert plain_masks == len(plain.token_ids)               # one mask per token
        assert fast_masks < plain_masks                          # keys and punctuation forced
        value = json.loads(fast.text)
        assert list(value) == ["name", "colour", "count"] and fast.stop_reason == "eos"


def test_the_uncached_loop_fast_forwards_too(shipped):
    model, tokenizer, grammars = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    grammar = grammars.json_schema(SCHEMA)
    cached, uncached = (generate(model, tokenizer.encode("the cat"), SamplingParams(
        temperature=0, max_new_tokens=80), eos_id=eos, constraint=grammar.constraint([eos]),
        use_cache=use) for use in (True, False))
    assert cached.token_ids == uncached.token_ids


def test_the_end_is_allowed_only_when_the_value_is_complete(shipped):
    model, tokenizer, grammars = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    constraint = grammars.regex("ab?").constraint([eos])
    allowed = constraint.allowed()
    assert not allowed[eos]
    a = tokenizer.encode("a")
    assert allowed[a[0]] and int(allowed.sum()) >= 1
    constraint.advance(a[0])
    allowed = constraint.allowed()
    assert allowed[eos]                                        # "a" matches: the end may come
    logits = constraint.mask(torch.zeros(1, model.cfg.vocab_size))
    assert torch.isinf(logits[0, ~allowed]).all() and not torch.isinf(logits[0, allowed]).any()
    with pytest.raises(GrammarError, match="does not continue"):
        constraint.advance(tokenizer.encode("z")[0])
    for bad, error in ((-1, ValueError), (model.cfg.vocab_size, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="token_id must be"):
            constraint.advance(bad)


def test_what_cannot_be_compiled_is_a_grammar_error_and_a_compile_is_cached(shipped):
    _, _, grammars = shipped
    for bad in (lambda: grammars.json_schema({"type": "objekt"}),
                lambda: grammars.regex("(("), lambda: grammars.choice([]),
                lambda: grammars.lark("start: missing_rule"),
                lambda: grammars.regex("a" * 300_000), lambda: grammars.regex(None),
                lambda: grammars.choice("abc"),       # read as "a" | "b" | "c" before
                lambda: grammars.json_schema(False), lambda: grammars.json_schema([1])):
        with pytest.raises(GrammarError):
            bad()
    assert grammars.json_schema(True) is grammars.json_schema({})    # any value, as {}
    first = grammars.json_schema({"const": "cached"})
    compiled = grammars.compiled
    assert grammars.json_schema({"const": "cached"}) is first and grammars.compiled == compiled
    with pytest.raises(ValueError, match="eos_ids"):
        first.constraint([])
    vocab_size = grammars.vocab_size
    for bad, index in (([vocab_size], 0), ([-1], 0), ([0, vocab_size + 5], 1)):
        with pytest.raises(ValueError,
                           match=rf"eos_ids\[{index}\] must be a token id in \[0, {vocab_size}\)"):
            first.constraint(bad)
    for bad in ([True], [1.0]):
        with pytest.raises(TypeError, match=r"eos_ids\[0\] must be an int token id"):
            first.constraint(bad)


def test_the_length_limit_counts_the_grammars_text_alone(shipped, monkeypatch):
    _, _, grammars = shipped
    with pytest.raises(GrammarError, match="has 300,000 characters; at most 200,000"):
        grammars.regex("a" * 300_000)
    monkeypatch.setattr(structured, "MAX_GRAMMAR_CHARS", 5)
    assert grammars.regex("abcde").key == "regex:abcde"          # 5 characters: at the limit
    with pytest.raises(GrammarError, match="has 6 characters; at most 5"):
        grammars.regex("abcdef")


def test_a_constraint_does_not_load_torchs_compiler():
    """Every server start builds a constraint (the grammar engine's warm-up): importing
    llguidance.torch there loaded torch._dynamo and inductor: 6-8 s of a 13-17 s start on the
    2-core AVX2 EPYC with tests running beside it (2026-11-28). The constraint fills its mask
    through llguidance.numpy instead."""
    code = ("import sys, torch\n"
            "from tinygpt import load_pretrained\n"
            "from tinygpt.structured import Grammars\n"
            "model, tok = load_pretrained()\n"
            "g = Grammars(tok, model.cfg.vocab_size).json_schema({'const': 'x'})\n"
            "allowed = g.constraint([0]).allowed()\n"
            "assert allowed.dtype == torch.bool and allowed.shape == (model.cfg.vocab_size,)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', "
            "'torch._inductor', 'llguidance.torch'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_only_the_requests_own_ends_are_allowed_never_the_engines(shipped):
    """Grammars gives the grammar engine <|endoftext|> as its end; a chat ends on its
    end-of-turn instead. The engine allowed its own end beside the chat's once the text was
    complete, and a model that preferred it wrote it as text until max_tokens."""
    _, tokenizer, grammars = shipped
    engine_eos = tokenizer.special_tokens["<|endoftext|>"]
    chat_eos = tokenizer.special_tokens["<|end|>"]
    for grammar, text in ((grammars.regex("(yes|no)"), "no"),
                          (grammars.choice(["red", "blue"]), "blue"),
                          (grammars.json_object(), '{"a": 1}')):
        constraint = grammar.constraint([chat_eos])
        for token in tokenizer.encode(text):
            assert not constraint.allowed()[engine_eos]
            constraint.advance(token)
        allowed = constraint.allowed()
        assert allowed.nonzero().flatten().tolist() == [chat_eos], text
    both = grammars.regex("(yes|no)").constraint([chat_eos, engine_eos])
    for token in tokenizer.encode("yes"):
        both.advance(token)
    assert both.allowed().nonzero().flatten().tolist() == [engine_eos, chat_eos]
