"""Day 19's fast-forward in the batching engine: the tokens a request's grammar forces are
appended without sampling and fed to the model in one pass, a short chunk among the decodes.
The oracles: the same engine with fast_forward=False (one decode step per token) and batch-1
`generate` (which fast-forwards in its own loop), token for token, under random arrivals,
budgets, pools small enough to preempt, prefix caching and both runner roads."""

from __future__ import annotations

import json
import random

import pytest

from tinygpt.engine import Engine
from tinygpt.generate import generate
from tinygpt.paged import PagedKVCache
from tinygpt.sampling import SamplingParams
from tinygpt.scheduler import Scheduler, Seq
from tinygpt.structured import Grammars

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "colour", "count"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
LIST = {"type": "array", "items": {"enum": ["the cat", "the dog", "a bird"]},
        "minItems": 1, "maxItems": 3}


@pytest.fixture(scope="module")
def shipped():
    from tinygpt.train import load_pretrained

    model, tokenizer = load_pretrained()
    return model.eval(), tokenizer, Grammars(tokenizer, model.cfg.vocab_size)


# -- the scheduler: a forced run is one chunk among the decodes --------------------------------

def test_a_forced_run_is_fed_in_one_chunk_and_leaves_each_decode_its_token():
    cache = PagedKVCache(1, 1, 2, num_blocks=64, block_size=4, max_len=64)
    s = Scheduler(cache, max_running=4, token_budget=9)
    seqs = [Seq(i, [1, 2, 3], 30, arrival=i) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    plan = s.schedule()                                   # the three prompts
    s.complete(plan.scheduled)
    for seq in seqs:
        seq.output_ids.append(9)                          # each sampled a token ...
    seqs[0].output_ids += [5, 6, 7, 8, 4, 5, 6, 7]        # ... and 0's grammar forced eight
    plan = s.schedule()
    shares = {item.seq.id: (item.start, item.n) for item in plan.scheduled}
    assert shares == {0: (3, 7), 1: (3, 1), 2: (3, 1)}    # the budget left after the decodes
    assert [item.samples for item in plan.scheduled] == [False, True, True]
    assert len(cache.tables[0]) * cache.block_size >= 3 + 7     # its positions were reserved
    s.complete(plan.scheduled)
    for seq in seqs[1:]:
        seq.output_ids.append(9)
    plan = s.schedule()
    assert {i.seq.id: (i.start, i.n) for i in plan.scheduled} == {0: (10, 2), 1: (4, 1),
                                                                   2: (4, 1)}
    assert [item.samples for item in plan.scheduled] == [True, True, True]


# -- the engine against its two oracles ---------------------------------------------------------

def _cases(tokenizer, grammars, rng):
    eos = tokenizer.special_tokens["<|endoftext|>"]
    texts = ["the cat", "a dog sat on", "once upon a time", "Tom and Lily went to the park",
             "She was happy because"]
    grammar_of = [lambda: grammars.json_schema(SCHEMA), lambda: grammars.json_schema(LIST),
                  lambda: grammars.regex(r"(yes|no), because the [a-z]{1,12}\."),
                  lambda: grammars.choice(["the little girl was happy", "the big dog"]),
                  lambda: grammars.regex(r"(the (cat|dog|bird) (sat|ran) on the (mat|rug)\. )"
                                         r"{6,9}"),
                  lambda: None]
    cases = []
    for i in range(18):
        grammar = grammar_of[i % len(grammar_of)]()
        # some too short for the grammar to finish: a forced run cut by max_new_tokens
        params = SamplingParams(temperature=0.0, max_new_tokens=rng.choice([3, 9, 20, 60]),
                                stop=(" dog",) if i % 7 == 3 else ())
        if i % len(grammar_of) == 4:        # long replies: a small pool must preempt them
            params = SamplingParams(temperature=0.0, max_new_tokens=60)
        cases.append((tokenizer.encode(rng.choice(texts)), params, grammar))
    return eos, cases


def _run(engine, cases, eos, arrivals):
    pending, ids, step = list(range(len(cases))), {}, 0
    while pending or engine.has_work:
        for _ in range(arrivals[step % len(arrivals)]):
            if pending:
                i = pending.pop()
                prompt, params, grammar = cases[i]
                ids[i] = engine.add_request(prompt, params, eos_ids=(eos,), constraint=None
                                            if grammar is None else grammar.constraint([eos]))
        engine.step()
        step += 1
    return [engine.result(ids[i]) for i in range(len(cases))]


def test_fast_forward_gives_the_tokens_of_the_plain_engine_and_of_batch_one(shipped):
    model, tokenizer, grammars = shipped
    rng = random.Random(19)
    eos, cases = _cases(tokenizer, grammars, rng)
    expected = [generate(model, prompt, params, eos_id=eos, tokenizer=tokenizer,
                         constraint=None if grammar is None else grammar.constraint([eos]))
                for prompt, params, grammar in cases]
    assert any(r.stop_reason == "length" for r, (_, _, g) in zip(expected, cases, strict=True)
               if g is not None)
    chunks = forced = preemptions = 0
    for trial in range(4):
        max_running = rng.choice([3, 6, 16])
        options = dict(block_size=rng.choice([4, 8]), num_blocks=rng.choice([24, 64]),
                       max_running=max_running, record=True,
                       token_budget=max(max_running, rng.choice([4, 12, 256])))
        arrivals = [rng.randint(0, 3) for _ in range(64)]
        if trial == 0:           # all at once, a small pool and budget: preemptions, split runs
            options.update(block_size=4, num_blocks=20, max_running=6, token_budget=7)
            arrivals = [len(cases)]
        steps = {}
        for fast in (False, True):
            engine = Engine(model, tokenizer, fast_forward=fast, batched=trial % 2 == 0,
                            prefix_caching=trial >= 2, **options)
            got = _run(engine, cases, eos, arrivals)
            for i, (want, result) in enumerate(zip(expected, got, strict=True)):
                assert result.token_ids == want.token_ids, (trial, fast, i)
                assert result.text == want.text and result.stop_reason == want.stop_reason, (
                    trial, fast, i)
            assert engine.cache.used_blocks == 0
            engine.cache.check()
            steps[fast] = engine.steps
            if fast:
                forced += engine.tokens_forced
                preemptions += engine.scheduler.num_preemptions
                # a run fed in one pass: the step after k tokens were forced feeds the
                # sampled token and the k in one chunk
                pairs = zip(engine.log, engine.log[1:], strict=False)
                chunks += sum(after.prefill.get(rid) == k + 1 for before, after in pairs
                              for rid, k in before.forced.items())
            else:
                assert engine.tokens_forced == 0 and not any(r.forced for r in engine.log)
        assert steps[True] < steps[False], (trial, steps)
    assert forced > 0 and chunks > 0 and preemptions > 0


def test_a_seeded_sampler_draws_only_for_sampled_tokens_as_batch_one_does(shipped):
    model, tokenizer, grammars = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    grammar = grammars.json_schema(SCHEMA)
    prompts = [tokenizer.encode(t) for t in ("the cat", "a dog sat on", "once upon a time")]
    params = [SamplingParams(temperature=1.0, max_new_tokens=60, seed=40 + i)
              for i in range(len(prompts))]
    engine = Engine(model, tokenizer, max_running=4)
    ids = [engine.add_request(p, sp, eos_ids=(eos,), constraint=grammar.constraint([eos]))
           for p, sp in zip(prompts, params, strict=True)]
    engine.run()
    assert engine.tokens_forced > 0
    for i, prompt, sp in zip(ids, prompts, params, strict=True):
        want = generate(model, prompt, sp, eos_id=eos, tokenizer=tokenizer,
                        constraint=grammar.constraint([eos]))
        got = engine.result(i)
        assert got.token_ids == want.token_ids
        assert set(json.loads(got.text)) == {"name", "colour", "count"}


def test_a_request_with_logprobs_is_not_fast_forwarded(shipped):
    model, tokenizer, grammars = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    grammar = grammars.json_schema(SCHEMA)
    params = SamplingParams(temperature=0.0, max_new_tokens=60)
    engine = Engine(model, tokenizer)
    rid = engine.add_request(tokenizer.encode("the cat"), params, eos_ids=(eos,), logprobs=2,
                             constraint=grammar.constraint([eos]))
    engine.run()
    result = engine.result(rid)
    assert engine.tokens_forced == 0
    assert len(engine.token_logprobs(rid)) == len(result.token_ids)   # one per token
    assert result.token_ids == generate(model, tokenizer.encode("the cat"), params,
                                        eos_id=eos, constraint=grammar.constraint([eos])
                                        ).token_ids
    with pytest.raises(TypeError, match="fast_forward"):
        Engine(model, tokenizer, fast_forward=1)
