"""`python -m tinygpt serve`'s flags (tinygpt/server/cli.py): bad values are one `error:` line
and exit 2 before the model loads (the loader is replaced by one that fails the test), an
address that cannot be bound is exit 1 before it too, and `--port 0` announces the port the
server got. Most tests call cli.main in process; the port tests start a real server."""

from __future__ import annotations

import asyncio
import os
import re
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest

import tinygpt
import tinygpt.loading
from tinygpt.bench.load import stop_server
from tinygpt.server import cli


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the refusal must come before it."""
    def load_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the flags were refused")

    monkeypatch.setattr(tinygpt.loading, "load_model", load_model)


def refused(argv: list[str], capsys, code: int = 2) -> str:
    """main(argv)'s exit code is `code`; returns its stderr, which is one `error:` line."""
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# -- 13: the token budget against the batch --------------------------------------------------

def test_a_token_budget_below_max_running_is_refused_naming_both(no_model, capsys):
    err = refused(["--max-running", "300"], capsys)        # against the default budget, 256
    assert "--token-budget (256) must be >= --max-running (300)" in err
    err = refused(["--token-budget", "8", "--max-running", "16"], capsys)
    assert "--token-budget (8) must be >= --max-running (16)" in err


# -- 14: seconds must be finite --------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--grace", "--body-timeout", "--header-timeout"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_seconds_must_be_finite(no_model, capsys, flag, value):
    err = refused([f"{flag}={value}"], capsys)     # "=": argparse reads -inf as a flag
    assert f"{flag} must be a finite number of seconds" in err and value in err


# -- 15: --threads ---------------------------------------------------------------------------

def test_thread_count_takes_1_to_4_per_usable_core():
    bound = 4 * tinygpt.usable_cores()
    assert tinygpt.thread_count(1) == 1 and tinygpt.thread_count(bound) == bound
    for bad in (0, -1, bound + 1, 100_000, 99999999999999999999999, True, 2.0, "2"):
        with pytest.raises(ValueError, match=rf"--workers must be an integer from 1 to "
                                             rf"{bound} \(4 per usable core"):
            tinygpt.thread_count(bad, "--workers")


@pytest.mark.parametrize("threads", ["0", "100000", "99999999999999999999999"])
def test_serve_refuses_a_thread_count_torch_cannot_take(no_model, capsys, threads):
    err = refused(["--threads", threads], capsys)
    assert f"--threads must be an integer from 1 to {4 * tinygpt.usable_cores()}" in err


# -- 16: the host ----------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_not_every_interface(no_model, capsys, host):
    err = refused(["--host", host, "--port", "0"], capsys)
    assert "--host must name an address" in err and "0.0.0.0" in err


# -- 17: binding before announcing, and the port that --port 0 got ---------------------------

def test_a_host_that_does_not_resolve_is_exit_1_before_the_model_loads(no_model, capsys):
    err = refused(["--host", "nosuch.invalid", "--port", "0"], capsys, code=1)
    assert err.startswith("error: --host nosuch.invalid: no such address")


def test_a_host_that_is_not_this_machine_s_is_exit_1(no_model, capsys):
    err = refused(["--host", "192.0.2.1", "--port", "0"], capsys, code=1)  # TEST-NET-1
    assert err.startswith("error: --host 192.0.2.1: not an address of this machine")


def announced_port(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    """The port in the server's `serving ... on http://127.0.0.1:PORT/v1` line."""
    deadline, seen = time.monotonic() + timeout, ""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stderr], [], [], 1.0)[0]:
            line = proc.stderr.readline().decode(errors="replace")
            seen += line
            found = re.search(r"^serving .* on http://127\.0\.0\.1:(\d+)/v1$", line.strip())
            if found:
                return int(found.group(1))
    raise AssertionError(f"no announcement (exit {proc.poll()}):\n{seen[-2000:]}")


@pytest.mark.slow
def test_port_0_announces_the_real_port_and_a_port_in_use_is_exit_1(no_model, capsys):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", "serve", "--port", "0",
                             "--threads", "1"], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, env=env)
    try:
        port = announced_port(proc)
        assert port != 0
        deadline = time.monotonic() + 60
        while True:                   # the announcement comes before uvicorn accepts
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        assert health.status_code == 200
        # a second server on the real server's port: the error names --port, no model loads
        err = refused(["--port", str(port)], capsys, code=1)
        assert err.startswith(f"error: --port {port}: Address already in use")
    finally:
        stop_server(proc)
        proc.stderr.close()


def test_a_port_in_use_is_exit_1_naming_the_port(no_model, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refused(["--port", str(port)], capsys, code=1)
    assert err.startswith(f"error: --port {port}: Address already in use")


# -- 18: flags that would be ignored ---------------------------------------------------------

def test_serial_refuses_the_batching_engine_s_flags(no_model, capsys):
    err = refused(["--engine", "serial", "--kv-blocks", "5", "--max-running", "7",
                   "--token-budget", "3", "--no-prefix-caching"], capsys)
    assert ("--engine serial has no batch, KV pool or prefix cache: drop --max-running, "
            "--token-budget, --kv-blocks, --no-prefix-caching") in err
    err = refused(["--engine", "serial", "--no-prefix-caching"], capsys)
    assert "drop --no-prefix-caching (" in err


@pytest.mark.parametrize("flags, prefix_caching", [((), True),
                                                   (("--no-prefix-caching",), False)])
def test_tensor_parallel_gets_the_prefix_caching_flag(monkeypatch, capsys, flags,
                                                      prefix_caching):
    import tinygpt.parallel

    seen = {}

    def start_tensor_parallel(*_args, **options):
        seen.update(options)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(tinygpt.parallel, "start_tensor_parallel", start_tensor_parallel)
    err = refused(["--tensor-parallel-size", "2", "--port", "0", *flags], capsys)
    assert "stopped by the test" in err
    assert seen["prefix_caching"] is prefix_caching


# -- 19: a KV pool too small for any ordinary request ----------------------------------------

def test_a_kv_pool_below_the_minimum_is_refused_with_the_minimum(capsys):
    tokenizer = tinygpt.loading.load_model("tinygpt")[1]
    least = cli.min_kv_blocks(tokenizer)
    assert least == 2           # tinygpt's template around "Hi": 5 tokens; + 16 - 1 = 20
    err = refused(["--kv-blocks", "1", "--port", "0"], capsys)
    assert "--kv-blocks 1 is too small for tinygpt: at least 2 blocks" in err


def test_a_model_without_a_chat_template_gets_a_minimum_too():
    # the server crashed at startup on it (a base model, a GGUF without a template): it serves
    # completions, and chat requests get their 400
    class NoTemplate:
        def encode_chat(self, messages):
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")

        def encode(self, text):
            return [7]

    assert cli.min_kv_blocks(NoTemplate()) == 1      # "Hi" alone: 1 token + 16 - 1 = 16


def test_the_minimum_pool_serves_default_requests():
    """A pool of min_kv_blocks answers a chat request with the defaults and a completion of
    /v1/completions' default length; one block fewer refuses that completion (the server
    admits what its pool holds: tinygpt.server.prompts' max_model_len)."""
    from tinygpt.engine import AsyncEngine
    from tinygpt.server import create_app

    model, tokenizer, _ = tinygpt.loading.load_model("tinygpt")
    least = cli.min_kv_blocks(tokenizer)

    async def statuses(blocks: int) -> list[int]:
        engine = AsyncEngine(model.eval(), tokenizer, num_blocks=blocks)
        app = create_app(engine, tokenizer, model.cfg.max_seq_len)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tinygpt") as http:
            chat = await http.post("/v1/chat/completions", json={
                "model": "tinygpt", "messages": [{"role": "user", "content": "Hi"}]})
            completion = await http.post("/v1/completions", json={
                "model": "tinygpt", "prompt": "The cat sat", "max_tokens": 16})
        await engine.shutdown(1.0)
        return [chat.status_code, completion.status_code]

    assert asyncio.run(statuses(least)) == [200, 200]
    assert asyncio.run(statuses(least - 1))[1] == 400


# -- a KV pool larger than the memory --------------------------------------------------------

def test_a_kv_pool_larger_than_the_memory_is_refused_with_the_largest(monkeypatch, capsys):
    import tinygpt.engine

    def engine(*_args, **_kwargs):
        raise AssertionError("the engine was built for a pool the memory cannot hold")

    monkeypatch.setattr(tinygpt.engine, "AsyncEngine", engine)
    model = tinygpt.loading.load_model("tinygpt")[0]
    block = cli.kv_block_bytes(model)
    assert block == 2 * model.cfg.n_layers * model.cfg.n_kv_heads * model.cfg.head_dim * 16 * 4
    most = cli.memory_bytes(torch_device("cpu")) // block
    for blocks in (most + 1, 100_000_000_000):
        err = refused(["--kv-blocks", str(blocks), "--port", "0"], capsys)
        assert err.startswith(f"error: --kv-blocks {blocks} asks for ")
        assert f"at most {most:,} blocks" in err


@pytest.mark.parametrize("failure", [
    MemoryError(),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes")])
def test_a_kv_pool_the_allocator_cannot_give_is_one_error_line(monkeypatch, capsys, failure):
    import tinygpt.engine

    def engine(*_args, **_kwargs):
        raise failure

    monkeypatch.setattr(tinygpt.engine, "AsyncEngine", engine)
    err = refused(["--kv-blocks", "40", "--port", "0"], capsys)
    assert err.startswith("error: --kv-blocks 40: the KV pool of ")
    assert type(failure).__name__ in err


def test_other_runtime_errors_building_the_engine_are_not_called_memory(monkeypatch):
    import tinygpt.engine

    def engine(*_args, **_kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(tinygpt.engine, "AsyncEngine", engine)
    with pytest.raises(RuntimeError, match="something else"):
        cli.main(["--kv-blocks", "40", "--port", "0"])


def torch_device(name: str):
    import torch

    return torch.device(name)


# -- the announcement counts the parameters as loaded -----------------------------------------

@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"], ["--quantize", "int4"]])
def test_the_announced_parameters_are_the_model_s_before_quantizing(monkeypatch, capsys,
                                                                    quantize):
    import uvicorn

    import tinygpt.engine
    import tinygpt.server.app

    monkeypatch.setattr(tinygpt.engine, "AsyncEngine", lambda *_args, **_kwargs: None)
    monkeypatch.setattr(tinygpt.server.app, "create_app", lambda *_args, **_kwargs: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    assert cli.main(["--port", "0", "--kv-blocks", "40", *quantize]) == 1   # never started
    model = tinygpt.loading.load_model("tinygpt")[0]
    expected = sum(p.numel() for p in model.parameters())
    assert re.search(rf"^serving tinygpt \({expected:,} parameters\) on ",
                     capsys.readouterr().err, re.M)
