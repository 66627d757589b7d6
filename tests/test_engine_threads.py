"""The asynchronous engines' worker thread against what its callers do: a client's event loop
that closes, a callback that raises, a step that fails, a shutdown while sequences are
preempted. Each case once stopped the worker or ended the wrong requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from tinygpt.engine import AsyncEngine, EngineClosed, SerialEngine
from tinygpt.generate import generate
from tinygpt.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def shipped():
    from tinygpt.train import load_pretrained
    model, tokenizer = load_pretrained()
    return model.eval(), tokenizer


async def _drain(request, timeout: float = 60.0):
    async def events():
        return [event async for event in request]
    return await asyncio.wait_for(events(), timeout)


def _wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("engine_class", [AsyncEngine, SerialEngine])
def test_a_client_whose_event_loop_closed_does_not_stop_the_worker(shipped, engine_class):
    """The worker hands events to each request's loop with call_soon_threadsafe, which raises
    once that loop has closed (a client that went away): the worker thread died of it, and
    every later request waited forever while /health said ok."""
    model, tok = shipped
    prompt = tok.encode("Once upon a time")
    engine = engine_class(model, tok)
    gone = asyncio.new_event_loop()
    request = gone.run_until_complete(engine.submit(
        prompt, SamplingParams(temperature=0.0, max_new_tokens=200)))
    gone.close()                                       # before the first token is handed over
    _wait_until(lambda: request.finish_reason is not None, "the orphan ends")
    assert request.finish_reason == "cancelled" and engine.alive

    async def later():
        try:
            done = await _drain(await engine.submit(prompt, GREEDY))
            assert [e.token_id for e in done] == generate(model, prompt, GREEDY).token_ids
            stats = engine.stats()
            assert (stats.submitted, stats.finished, stats.cancelled) == (2, 1, 1)
        finally:
            await engine.shutdown(1.0)
    asyncio.run(later())
    assert not engine.alive


@pytest.mark.parametrize("engine_class", [AsyncEngine, SerialEngine])
def test_an_on_finish_callback_that_raises_does_not_stop_the_worker(shipped, engine_class,
                                                                    caplog):
    model, tok = shipped
    prompt = tok.encode("The cat sat on the")
    seen = []

    def on_finish(request):
        seen.append(request.id)
        raise RuntimeError("a metrics bug")

    async def main():
        engine = engine_class(model, tok, on_finish=on_finish)
        try:
            for _ in range(2):
                done = await _drain(await engine.submit(prompt, GREEDY))
                assert done[-1].finish_reason == "length"
            _wait_until(lambda: len(seen) == 2, "both callbacks ran")   # after the last event
            assert engine.alive
        finally:
            await engine.shutdown(1.0)
    asyncio.run(main())
    assert "on_finish failed" in caplog.text and "a metrics bug" in caplog.text


def test_a_worker_that_fails_ends_what_it_holds_and_refuses_the_rest(shipped, monkeypatch,
                                                                    caplog):
    """A bug in the worker's own loop (here: reading a step's failures raises) used to end
    the thread with every request it held waiting forever and new ones queued to nobody."""
    model, tok = shipped

    def broken():
        raise RuntimeError("a bug in the loop")

    async def main():
        engine = AsyncEngine(model, tok)
        monkeypatch.setattr(engine.engine, "failures", broken)
        try:
            held = await engine.submit(tok.encode("A dog"), GREEDY)
            events = await _drain(held)
            assert events[-1].finish_reason == "error"
            assert "the engine stopped: RuntimeError: a bug in the loop" in events[-1].error
            await asyncio.to_thread(engine._thread.join, 30)
            assert not engine.alive
            with pytest.raises(EngineClosed):
                await engine.submit(tok.encode("A dog"), GREEDY)
        finally:
            await engine.shutdown(0.1)
    asyncio.run(main())
    assert "worker thread stopped" in caplog.text


def test_shutdown_gives_a_preempted_request_its_grace(shipped):
    """Shutting down cancels the requests that never ran; one that ran and was preempted back
    into the waiting queue is running work and gets the grace period like the others (it was
    cancelled mid-stream: a 503 halfway through a reply)."""
    model, tok = shipped
    prompt = tok.encode("Once upon a time")
    params = SamplingParams(temperature=0.0, max_new_tokens=100)

    async def main():
        # 2 sequences fit 8 blocks of 16 at first; both grow, the newer is preempted
        engine = AsyncEngine(model, tok, max_running=2, token_budget=64, num_blocks=8,
                             block_size=16)
        requests = [await engine.submit(prompt, params) for _ in range(2)]
        drains = [asyncio.ensure_future(_drain(r)) for r in requests]
        while engine.stats().running < 2:
            await asyncio.sleep(0.005)
        await engine.shutdown(grace_s=60.0)
        results = [await d for d in drains]
        assert engine.stats().preemptions >= 1
        want = generate(model, prompt, params).token_ids
        for events in results:
            assert events[-1].finish_reason == "length"
            assert [e.token_id for e in events] == want
    asyncio.run(main())


def test_a_failed_step_fails_its_batch_and_not_the_waiting_queue(shipped, monkeypatch):
    model, tok = shipped
    prompt = tok.encode("The bird")

    async def main():
        engine = AsyncEngine(model, tok, max_running=1)
        forward = engine.engine.runner.forward
        calls = []

        def fails_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected forward failure")
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine.engine.runner, "forward", fails_once)
        try:
            first = await engine.submit(prompt, GREEDY)
            second = await engine.submit(prompt, GREEDY)     # waits: max_running=1
            failed = await _drain(first)
            assert failed[-1].finish_reason == "error"
            assert "injected forward failure" in failed[-1].error
            done = await _drain(second)
            assert [e.token_id for e in done] == generate(model, prompt, GREEDY).token_ids
            assert engine.stats().kv_blocks_used == 0
        finally:
            await engine.shutdown(1.0)
    asyncio.run(main())


def test_a_closed_engine_says_so(shipped):
    model, tok = shipped

    async def main():
        engine = AsyncEngine(model, tok)
        await engine.shutdown(0.1)
        assert not engine.alive
        with pytest.raises(EngineClosed):
            await engine.submit(tok.encode("It"), GREEDY)
    asyncio.run(main())


@pytest.mark.parametrize("engine_class", [AsyncEngine, SerialEngine])
def test_text_held_back_for_a_stop_string_is_released_when_the_reply_ends_at_eos(
        shipped, engine_class):
    """With stop=[". "], a story's final "." is held back (it could begin ". "); the EOS that
    follows releases it. The server's events dropped it (an EOS event's text was blanked),
    and so did a second end id (a chat's end of turn beside <|endoftext|>), decoded as text."""
    from tinygpt.generate import eos_id_of
    model, tok = shipped
    eos = eos_id_of(tok)
    prompt = [eos] + tok.encode("The cat sat on the")
    params = SamplingParams(temperature=0.0, max_new_tokens=300, stop=(". ",))
    want = generate(model, prompt, params, eos_id=eos, tokenizer=tok)
    assert want.stop_reason == "eos" and want.text.endswith(".")
    other = next(i for i in range(tok.vocab_size) if i != eos and i not in want.token_ids)

    async def main():
        engine = engine_class(model, tok)
        try:
            for eos_ids in ((eos,), (other, eos)):
                events = await _drain(await engine.submit(prompt, params, eos_ids))
                assert "".join(e.text for e in events) == want.text, eos_ids
                assert events[-1].finish_reason == "stop"
                assert [e.token_id for e in events] == want.token_ids
        finally:
            await engine.shutdown(1.0)
    asyncio.run(main())
