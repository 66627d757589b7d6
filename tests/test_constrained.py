"""Day 19's constrained decoding (tinygpt.constrained).

The DFA is checked against Python's re.fullmatch (flag re.ASCII, as the subset's \\d \\w \\s are
ASCII) on random strings and on strings hypothesis draws from each pattern; the trie walk and the
per-state index against the naive per-token loop (a small vocabulary, and SmolLM2's 49,152
tokens for two states); masked greedy against an argmax over the allowed tokens; the JSON
Schema regexes against json.dumps of valid and invalid objects; and an end-to-end run of the
shipped tiny model that must produce JSON with the schema's fields.
"""

from __future__ import annotations

import json
import random
import re
from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinygpt
from tinygpt.constrained import (
    DFA,
    TokenIndex,
    VocabTrie,
    allowed_tokens,
    compile_regex,
    constrained_generate,
    mask_logits,
    schema_to_regex,
    token_strings,
)
from tinygpt.native import torch_single_thread
from tinygpt.sampling import SamplingParams, sample_next_token

CHECKS = settings(max_examples=40, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

PATTERNS = [
    "abc", "a|b|", "(ab|a)*b", "a+b?c*", "[a-z0-9_]+", '[^"]*', r'"([^"\\]|\\.)*"',
    r"\d{3}", r"\d{2,4}", r"\w+\s\w*", r"(a|bc){1,3}d", ".*x.", "x{0}", "((a|b)c?)+",
    r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?", "a{2,}", "[]a]", "[a-]", r"[\d.]+", "(?:ab)*",
    r"\\\.\"", r"\x41\t", "()", r"[^\s\S]a|b", r"\D\W\S", "(a*)*b", "(|a)+",
]


def alphabet(pattern: str) -> list[str]:
    return sorted(set(pattern) | set('ab09 \n"\\.xAé\t'))


def completion(dfa: DFA, state: int) -> str | None:
    """A shortest text that takes `state` to an accepting state (breadth first), or None."""
    seen, queue = {state: ""}, deque([state])
    while queue:
        s = queue.popleft()
        if dfa.accepts(s):
            return seen[s]
        for lo, _, t in dfa.transitions[s]:
            if t not in seen:
                seen[t] = seen[s] + chr(lo)
                queue.append(t)
    return None


def matches(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


# ----------------------------------------------------------------------------------------------
# the DFA
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_agrees_with_re_on_random_strings(pattern):
    dfa = compile_regex(pattern)

    @CHECKS
    @given(st.text(alphabet=alphabet(pattern), max_size=10))
    def check(text):
        assert dfa.fullmatch(text) == matches(pattern, text)
        state = dfa.walk(dfa.start, text)
        if state is None:                 # dead: no continuation may match
            assert not any(matches(pattern, text + end) for end in ("", "a", "b", "0", '"'))
        else:                             # alive: the shortest completion makes a match
            assert dfa.live(state)
            assert matches(pattern, text + completion(dfa, state))

    check()


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if p != r"[^\s\S]a|b"])
def test_dfa_accepts_what_re_generates_and_every_prefix_is_alive(pattern):
    dfa = compile_regex(pattern)

    @CHECKS
    @given(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True))
    def check(text):
        state = dfa.start
        for ch in text:
            assert dfa.live(state)
            state = dfa.step(state, ch)
            assert state is not None, f"{text!r} matches but the DFA died at {ch!r}"
        assert dfa.accepts(state)

    check()


def test_step_walk_and_live_basics():
    dfa = compile_regex("ab*c")
    s = dfa.step(dfa.start, "a")
    assert dfa.walk(dfa.start, "abbb") == dfa.step(dfa.walk(dfa.start, "abb"), "b")
    assert dfa.step(s, "x") is None and dfa.walk(dfa.start, "xab") is None
    assert not dfa.accepts(s) and dfa.accepts(dfa.walk(s, "bc")) and dfa.live(s)
    assert dfa.walk(s, "") == s and dfa.walk(None, "abc") is None
    for nothing in (r"[^\s\S]", r"a[^\s\S]b", r"([^\s\S]|[^\d\D])+"):   # match no string
        with pytest.raises(ValueError, match="matches no string"):
            compile_regex(nothing)
    assert compile_regex(r"[^\s\S]*").fullmatch("")       # the empty text does match this one
    with pytest.raises(ValueError, match="single character"):
        dfa.step(s, "bc")
    with pytest.raises(ValueError, match=r"state must be an int in \[0, "):
        dfa.accepts(dfa.num_states)
    assert compile_regex(".").fullmatch("\U0010ffff") and not compile_regex(".").fullmatch("\n")


@pytest.mark.parametrize("pattern,position", [
    ("(ab", 0), ("ab)", 2), ("a**", 2), ("*a", 0), ("a|+", 2), ("[a-", 0), ("[z-a]", 1),
    ("a{3,1}", 1), ("a{", 2), ("a{2", 1), (r"\b", 0), ("^a", 0), ("a$", 1), ("(?=a)", 0),
    ("ab\\", 2), ("a{1001}", 2), (r"[\d-z]", 1), (r"\x4", 0), ("a+?", 2), ("[]", 0),
])
def test_malformed_or_unsupported_patterns_name_the_position(pattern, position):
    with pytest.raises(ValueError, match=rf"regex .*, position {position}: .*subset allows"):
        compile_regex(pattern)


def test_state_count_is_bounded():
    hostile = "(a|b)*a(a|b){12}"                  # the DFA must remember the last 13 letters
    with pytest.raises(ValueError, match="more than max_states = 1000 DFA states"):
        compile_regex(hostile, max_states=1000)
    assert compile_regex("(a|b)*a(a|b){5}").num_states >= 2 ** 6     # not minimized: 65
    with pytest.raises(ValueError, match="MAX_NFA_STATES"):
        compile_regex("((a{1000}){1000}){1000}")
    with pytest.raises(ValueError, match="max_states must be an int >= 1"):
        compile_regex("a", max_states=0)


# ----------------------------------------------------------------------------------------------
# the vocabulary walk
# ----------------------------------------------------------------------------------------------

def assert_same_mask(expected: torch.Tensor, got: torch.Tensor, vocab) -> None:
    diff = (expected != got).nonzero().flatten().tolist()
    assert not diff, "masks differ at " + ", ".join(
        f"{i} {vocab[i]!r} (expected {bool(expected[i])})" for i in diff[:5])


def small_vocab(seed: int = 0, size: int = 300) -> list[str | None]:
    rng = random.Random(seed)
    chars = 'ab01 ."\\{}:,xé'
    vocab = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 4))) for _ in range(size)]
    return vocab + [None, "", None] + list(chars)   # id `size` plays EOS


@pytest.mark.parametrize("pattern", PATTERNS + [schema_to_regex(
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", 1]}},
     "required": ["a", "b"]})])
def test_trie_walk_and_index_equal_the_naive_loop(pattern):
    vocab, eos = small_vocab(), 300
    dfa = compile_regex(pattern)
    plain, by_class, index = VocabTrie(vocab), VocabTrie(vocab, dfa), TokenIndex(dfa, vocab, eos)
    states = random.Random(1).sample(range(dfa.num_states), min(dfa.num_states, 12))
    for state in states:
        expected = allowed_tokens(dfa, state, vocab, eos)
        assert bool(expected[eos]) == dfa.accepts(state)
        for got in (plain.mask(dfa, state, eos), by_class.mask(dfa, state, eos),
                    index.mask(state)):
            assert_same_mask(expected, got, vocab)
        for token_id in expected.nonzero().flatten().tolist():   # each can still finish
            if token_id != eos:
                after = dfa.walk(state, vocab[token_id])
                assert dfa.live(after) and completion(dfa, after) is not None
    assert index.mask(dfa.start) is index.mask(dfa.start)      # memoized


def test_a_wrong_mask_is_caught():
    vocab = small_vocab()
    dfa = compile_regex(r'"[^"]*"')
    mask = allowed_tokens(dfa, dfa.start, vocab).clone()
    mask[vocab.index("a")] = True          # 'a' cannot start a JSON string
    with pytest.raises(AssertionError, match=r"masks differ at \d+ 'a' \(expected False\)"):
        assert_same_mask(allowed_tokens(dfa, dfa.start, vocab), mask, vocab)
    with pytest.raises(ValueError, match="was built on another DFA"):
        VocabTrie(vocab, compile_regex("a")).mask(dfa, dfa.start)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from tinygpt.gguf import smollm2_path
    from tinygpt.gguf_tokenizer import GGUFTokenizer

    try:
        return GGUFTokenizer.from_gguf(smollm2_path())
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 is not installed: {err}")


def test_trie_walk_equals_the_naive_loop_on_smollm2(smollm2_tokenizer):
    tok = smollm2_tokenizer
    vocab = token_strings(tok, tok.vocab_size)
    assert len(vocab) == 49152
    assert sum(v is None for v in vocab) == len(tok.special_tokens) + 313   # + lone UTF-8 bytes
    dfa = compile_regex(schema_to_regex(
        {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
         "required": ["name", "n"]}))
    index = TokenIndex(dfa, vocab, tok.eos_id)
    inside = dfa.walk(dfa.start, '{"name":"Al')
    for state in (dfa.start, inside):
        expected = allowed_tokens(dfa, state, vocab, tok.eos_id)
        assert_same_mask(expected, index.mask(state), vocab)
    start = allowed_tokens(dfa, dfa.start, vocab, tok.eos_id).nonzero().flatten().tolist()
    assert start and all('{"name":"'.startswith(vocab[i]) for i in start)
    assert index.mask(inside).sum() > 48000                 # nearly anything fits in a string
    done = dfa.walk(dfa.start, '{"name":"Al","n":12}')
    assert index.mask(done).nonzero().flatten().tolist() == [tok.eos_id]


def test_token_strings_of_the_course_tokenizer():
    _, tok = tinygpt.load_pretrained()
    vocab = token_strings(tok, tok.vocab_size + 2)             # a model may pad its vocabulary
    assert vocab[ord("a")] == "a" and vocab[0x80] is None and vocab[0xC3] is None
    assert all(vocab[i] is None for i in tok.special_tokens.values())
    assert vocab[-2:] == [None, None]
    assert all(v == tok.decode([i]) for i, v in enumerate(vocab) if v is not None)

    class DecodeOnly:                       # no token_bytes: decode alone, U+FFFD means invalid
        def decode(self, ids):
            return {0: "x", 1: "\ufffd", 2: ""}[ids[0]]

    assert token_strings(DecodeOnly(), 3) == ["x", None, None]


# ----------------------------------------------------------------------------------------------
# masking and the generate loop
# ----------------------------------------------------------------------------------------------

def test_masked_greedy_is_the_argmax_over_allowed_tokens():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, 50, generator=gen)
        allowed = torch.rand(50, generator=gen) < 0.2
        allowed[int(torch.randint(50, (1,), generator=gen))] = True
        chosen = sample_next_token(mask_logits(logits, allowed), SamplingParams(temperature=0))
        best = max(allowed.nonzero().flatten().tolist(), key=lambda i: logits[0, i])
        assert int(chosen) == best
        assert not torch.isinf(mask_logits(logits, allowed)[0, allowed]).any()
    with pytest.raises(ValueError, match="no True entry"):
        mask_logits(torch.zeros(2, 5), torch.tensor([[True] * 5, [False] * 5]))
    with pytest.raises(ValueError, match=r"allowed must have shape \(5,\)"):
        mask_logits(torch.zeros(1, 5), torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="torch.bool"):
        mask_logits(torch.zeros(1, 5), torch.ones(5))


class BigramModel(torch.nn.Module):
    """Logits from a fixed table indexed by the last token; records every context it reads."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        self.cfg = type("Cfg", (), {"vocab_size": vocab_size, "max_seq_len": 64})()
        self.table = torch.randn(vocab_size, vocab_size,
                                 generator=torch.Generator().manual_seed(seed))
        self.seen: list[list[int]] = []

    def forward(self, ids):
        self.seen.append(ids[0].tolist())
        return self.table[ids]


def test_forced_tokens_are_counted_and_sampled_ones_are_the_masked_argmax():
    vocab = ["{", "}", '"', "a", "b", "ab", '{"', "c", None]        # id 8 plays EOS
    dfa = compile_regex(r'\{"(a|b){1,3}"\}')
    model = BigramModel(len(vocab))
    params = SamplingParams(temperature=0, max_new_tokens=20)
    result = constrained_generate(model, None, [7], TokenIndex(dfa, vocab, 8), params, eos_id=8)
    assert result.stop_reason == "eos" and result.complete and result.text is None
    state, context, forced = dfa.start, [7], 0                     # replay it independently
    for token in result.token_ids:
        allowed = allowed_tokens(dfa, state, vocab, 8)
        assert allowed[token]
        if allowed.sum() == 1:
            forced += 1
        else:
            assert context in model.seen      # the model read the whole context, forced included
            logits = model.table[context[-1]]
            assert token == max(allowed.nonzero().flatten().tolist(), key=lambda i: logits[i])
        context.append(token)
        state = dfa.walk(state, vocab[token] or "")
    assert forced == result.forced >= 2 and result.forward_passes == len(model.seen)
    assert result.forward_passes == len(result.token_ids) - forced
    assert dfa.fullmatch("".join(vocab[t] for t in result.token_ids[:-1]))
    with pytest.raises(ValueError, match="stop strings are not used"):
        constrained_generate(model, None, [7], TokenIndex(dfa, vocab, 8),
                             SamplingParams(stop="x"), eos_id=8)
    with pytest.raises(ValueError, match="built for eos_id=8"):
        constrained_generate(model, None, [7], TokenIndex(dfa, vocab, 8), params, eos_id=1)
    with pytest.raises(ValueError, match="tokenizer=None needs a TokenIndex"):
        constrained_generate(model, None, [7], dfa, params, eos_id=8)


# ----------------------------------------------------------------------------------------------
# JSON Schema
# ----------------------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "pet": {"enum": ["cat", "dog", "bird"]},
        "happy": {"type": "boolean"},
        "score": {"type": "number"},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "kind": {"const": "person"},
    },
    "required": ["name", "age", "pet", "happy", "score", "toys", "kind"],
    "additionalProperties": False,
}


def person(**changes):
    value = {"name": "Ann \"A\" é", "age": -3, "pet": "cat", "happy": True, "score": 2.5e-3,
             "toys": ["ball", "kite"], "kind": "person"}
    value.update(changes)
    return value


def check_person(obj) -> None:
    """Validate a PERSON by hand (the end-to-end test's judge)."""
    assert list(obj) == PERSON["required"]
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert obj["pet"] in ("cat", "dog", "bird") and isinstance(obj["happy"], bool)
    assert isinstance(obj["score"], (int, float)) and not isinstance(obj["score"], bool)
    assert isinstance(obj["toys"], list) and len(obj["toys"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 8 for t in obj["toys"])
    assert obj["kind"] == "person"


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


@pytest.mark.parametrize("value,ok", [
    (person(), True), (person(toys=[]), True), (person(name="", age=0, score=-1), True),
    (person(score=1e100, pet="bird", happy=False), True), (person(name="a\nb\\c"), True),
    (person(age=1.5), False), (person(pet="cow"), False), (person(happy=1), False),
    (person(toys=["a", "b", "c", "d"]), False), (person(name="x" * 13), False),
    (person(toys=[1]), False), (person(kind="Person"), False), (person(extra=1), False),
    ({k: v for k, v in person().items() if k != "age"}, False),
    (dict(reversed(list(person().items()))), False),
])
def test_schema_regex_matches_exactly_the_valid_objects(value, ok):
    pattern = schema_to_regex(PERSON)
    text = compact(value)
    assert matches(pattern, text) == ok
    assert compile_regex(pattern).fullmatch(text) == ok
    assert not matches(pattern, json.dumps(value))           # whitespace is not allowed
    if ok:
        check_person(json.loads(text))


def test_every_string_of_a_schema_regex_is_valid_json_of_the_schema():
    pattern = schema_to_regex(PERSON)

    @CHECKS
    @given(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True))
    def check(text):
        check_person(json.loads(text))

    check()
    with pytest.raises(AssertionError):
        check_person(person(pet="cow"))                      # the judge can fail


@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "properties": {"e": {"type": "string", "format": "email"}},
      "required": ["e"]}, "keyword 'format'"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}},
      "required": ["n"]}, "keyword 'minimum'"),
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {}}},
      "required": ["o"]}, "nested objects"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "array"}}},
      "required": ["a"]}, r"\$\.a\.items"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": []},
     "every property must be required"),
    ({"type": "object", "properties": {}, "additionalProperties": True},
     "additionalProperties must be False"),
    ({"type": "array", "items": {"type": "integer"}}, "top level must have type 'object'"),
    ({"type": "object", "properties": {"a": {"type": ["string", "null"]}}, "required": ["a"]},
     r"supported are a type among \['boolean'"),
    ({"type": "object", "properties": {"a": {"enum": [[1]]}}, "required": ["a"]},
     "nested values need a grammar"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "null"},
                                             "minItems": 3, "maxItems": 2}},
      "required": ["a"]}, "minItems 3 > maxItems 2"),
    ({"type": "object", "patternProperties": {}}, "keyword 'patternProperties'"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 1001}},
      "required": ["s"]}, r"schema at \$\.s: minLength must be an int in \[0, MAX_REPEAT"),
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 5000}},
      "required": ["s"]}, r"schema at \$\.s: maxLength must be an int in \[0, MAX_REPEAT"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "null"},
                                             "maxItems": 2000}},
      "required": ["a"]}, r"schema at \$\.a: maxItems must be an int in \[0, MAX_REPEAT"),
])
def test_unsupported_schemas_are_refused_by_name(schema, message):
    with pytest.raises(ValueError, match=message):
        schema_to_regex(schema)


def test_array_bounds():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "null"},
                                                     "minItems": 2, "maxItems": 3}},
              "required": ["a"]}
    dfa = compile_regex(schema_to_regex(schema))
    assert [dfa.fullmatch(compact({"a": [None] * n})) for n in range(5)] == \
        [False, False, True, True, False]


def test_array_min_items_without_max_items():
    """minItems alone still bounds the array from below (it once became a plain `*`)."""
    for lo in (0, 1, 2, 3):
        prop = {"type": "array", "items": {"type": "integer"}}
        if lo:
            prop["minItems"] = lo
        dfa = compile_regex(schema_to_regex({"type": "object", "properties": {"a": prop},
                                             "required": ["a"]}))
        assert [dfa.fullmatch(compact({"a": list(range(n))})) for n in range(6)] == \
            [n >= lo for n in range(6)], lo


def test_a_property_named_items_may_be_an_array():
    """Only an array's items may not be an array; a field's name does not decide that."""
    for name in ("items", "tags"):
        schema = {"type": "object", "required": [name],
                  "properties": {name: {"type": "array", "items": {"type": "integer"}}}}
        dfa = compile_regex(schema_to_regex(schema))
        assert dfa.fullmatch(compact({name: [1, 2]})) and not dfa.fullmatch(compact({name: 1}))


# ----------------------------------------------------------------------------------------------
# end to end
# ----------------------------------------------------------------------------------------------

class WithoutCache(torch.nn.Module):
    """The same model behind a forward without kv_cache: constrained_generate re-reads the
    whole context each pass instead of prefilling the unseen tokens into a cache."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def forward(self, ids):
        return self.model(ids)


def test_tiny_model_writes_json_that_validates():
    model, tok = tinygpt.load_pretrained()
    model.eval()
    vocab = token_strings(tok, model.cfg.vocab_size)
    index = TokenIndex(compile_regex(schema_to_regex(PERSON)), vocab, tok.eot_id).precompute()
    prompt = [tok.eot_id] + tok.encode("the little girl has a cat.")
    for params in (SamplingParams(temperature=0, max_new_tokens=150),
                   SamplingParams(temperature=1.0, top_k=20, seed=3, max_new_tokens=150)):
        result = constrained_generate(model, tok, prompt, index, params, eos_id=tok.eot_id)
        assert result.stop_reason == "eos" and result.complete, result
        check_person(json.loads(result.text))
        assert result.forced > 0 and result.forward_passes < len(result.token_ids)
        with torch_single_thread():      # a 2-thread forward is slow on a busy 2-core machine
            again = constrained_generate(WithoutCache(model), tok, prompt, index, params,
                                         eos_id=tok.eot_id)
        assert again.token_ids == result.token_ids


def test_a_quantized_model_decodes_with_its_own_step():
    # DecodeStep refuses a quantized model; the uncached forward is the oracle
    import copy

    from tinygpt.quant import quantize_model

    model, tok = tinygpt.load_pretrained()
    quantized = quantize_model(copy.deepcopy(model).eval(), "int8")
    vocab = token_strings(tok, model.cfg.vocab_size)
    index = TokenIndex(compile_regex(schema_to_regex(PERSON)), vocab, tok.eot_id).precompute()
    prompt = [tok.eot_id] + tok.encode("the little girl has a cat.")
    params = SamplingParams(temperature=0, max_new_tokens=60)
    result = constrained_generate(quantized, tok, prompt, index, params, eos_id=tok.eot_id)
    with torch_single_thread():
        again = constrained_generate(WithoutCache(quantized), tok, prompt, index, params,
                                     eos_id=tok.eot_id)
    assert result.token_ids == again.token_ids and result.forward_passes > 1
