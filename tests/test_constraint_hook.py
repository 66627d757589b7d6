"""The hook day 19's structured outputs hang on: a per-request `constraint` (mask(logits) ->
logits, advance(token)) in generate(), the batching Engine, AsyncEngine and SerialEngine. The
oracle is batch-1 generate() with the same constraint and seed: the engine, batching
constrained requests with unconstrained ones, must give each request exactly its tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tinygpt.engine import AsyncEngine, Engine, SerialEngine
from tinygpt.generate import generate
from tinygpt.sampling import SamplingParams


@pytest.fixture(scope="module")
def shipped():
    from tinygpt.train import load_pretrained

    model, tokenizer = load_pretrained()
    return model.eval(), tokenizer


class Script:
    """Allows only script[i] at step i, then only `end`; records what it saw."""

    def __init__(self, script: list[int], end: int) -> None:
        self.script, self.end, self.seen, self.shapes = script, end, [], []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(logits.shape))
        allowed = self.script[len(self.seen)] if len(self.seen) < len(self.script) else self.end
        out = torch.full_like(logits, float("-inf"))
        out[:, allowed] = logits[:, allowed]
        return out

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)


class EvenIds:
    """Allows the even token ids only (a constraint that still leaves sampling a choice)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        out[:, 1::2] = float("-inf")
        return out

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)


def test_generate_follows_the_constraint_whatever_the_model_prefers(shipped):
    model, tokenizer = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    script = [5, 17, 3, 250]
    constraint = Script(script, eos)
    result = generate(model, tokenizer.encode("the cat"), SamplingParams(
        temperature=1.5, max_new_tokens=10, seed=3), eos_id=eos, constraint=constraint)
    assert result.token_ids == script + [eos] and result.stop_reason == "eos"
    assert constraint.seen == result.token_ids                # advanced with every token
    vocab = model.cfg.vocab_size
    assert constraint.shapes == [(1, vocab)] * len(result.token_ids)
    free = generate(model, tokenizer.encode("the cat"), SamplingParams(
        temperature=1.5, max_new_tokens=10, seed=3), eos_id=eos)
    assert free.token_ids != result.token_ids                 # the constraint did something


def test_the_engine_gives_each_constrained_request_its_batch_one_tokens(shipped):
    model, tokenizer = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    prompts = [tokenizer.encode(text) for text in ("the cat", "a dog sat", "on the mat",
                                                   "once upon")]
    params = [SamplingParams(temperature=0.9, max_new_tokens=12, seed=10 + i)
              for i in range(len(prompts))]
    constrained = {0, 2}
    engine = Engine(model, tokenizer, num_blocks=64, block_size=4)
    constraints = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        constraints[i] = EvenIds() if i in constrained else None
        engine.add_request(prompt, p, eos_ids=(eos,), request_id=i, constraint=constraints[i])
    while engine.has_work:
        engine.step()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        want = generate(model, prompt, p, eos_id=eos,
                        constraint=EvenIds() if i in constrained else None)
        got = engine.result(i).token_ids
        assert got == want.token_ids, i
        if i in constrained:
            assert all(t % 2 == 0 for t in got) and constraints[i].seen == got
    assert any(t % 2 for i in set(range(len(prompts))) - constrained
               for t in engine.result(i).token_ids)        # the others were not masked


@pytest.mark.parametrize("engine_class", [AsyncEngine, SerialEngine])
def test_the_async_engines_pass_the_constraint_on(shipped, engine_class):
    model, tokenizer = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    script = [7, 9, 11]

    async def run() -> list[int]:
        engine = engine_class(model, tokenizer)
        try:
            request = await engine.submit(tokenizer.encode("the"), SamplingParams(
                temperature=1.0, max_new_tokens=8, seed=1), (eos,),
                constraint=Script(script, eos))
            return [event.token_id async for event in request]
        finally:
            await engine.shutdown(1.0)

    assert asyncio.run(run()) == script + [eos]


class Breaks:
    """A constraint whose third mask raises (a grammar past its limits, say)."""

    def __init__(self) -> None:
        self.masks = 0

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        self.masks += 1
        if self.masks == 3:
            raise ValueError("the grammar gave up")
        return logits

    def advance(self, token_id: int) -> None:
        pass


def test_a_failing_constraint_ends_its_request_alone(shipped):
    model, tokenizer = shipped
    eos = tokenizer.special_tokens["<|endoftext|>"]
    prompts = [tokenizer.encode(t) for t in ("the cat", "a dog", "on the mat")]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    engine = Engine(model, tokenizer, num_blocks=64, block_size=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, eos_ids=(eos,), request_id=i,
                           constraint=Breaks() if i == 1 else None)
    failed = {}
    while engine.has_work:
        engine.step()
        failed.update(engine.failures())
    assert failed == {1: "ValueError: the grammar gave up"} and engine.failures() == {}
    for i in (0, 2):                      # the others: their batch-1 tokens, whole
        assert engine.result(i).token_ids == generate(model, prompts[i], params,
                                                      eos_id=eos).token_ids
