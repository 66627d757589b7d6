"""`python -m tinygpt serve --tensor-parallel-size 2`: the shipped model split over two local
ranks answers the official openai client exactly as one process does, and a rank that dies
takes the server down with a clear message instead of hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tinygpt import load_pretrained
from tinygpt.bench.load import running_server
from tinygpt.engine import Engine
from tinygpt.generate import generate
from tinygpt.sampling import SamplingParams

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (the ranks are children of multiprocessing's fork server)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _is_rank(pid: int) -> bool:
    try:                                          # the name a rank gives itself (Linux)
        return Path(f"/proc/{pid}/comm").read_text().startswith("tinygpt-rank")
    except OSError:
        return False


def test_tensor_parallel_server_matches_one_process():
    model, tokenizer = load_pretrained()
    eos = tokenizer.special_tokens["<|endoftext|>"]
    prompts = ["The cat sat on the", "Once upon a time", "The dog"]
    with running_server("--threads", "1", "--tensor-parallel-size", "2", env=ENV) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0)
        for prompt in prompts:
            got = client.completions.create(model="tinygpt", prompt=prompt, max_tokens=12,
                                            temperature=0)
            want = generate(model, tokenizer.encode(prompt),
                            SamplingParams(temperature=0, max_new_tokens=12), eos_id=eos,
                            tokenizer=tokenizer)
            assert got.choices[0].text == want.text, prompt
        # sampled with a seed: the same text as the one-process engine with that seed
        got = client.completions.create(model="tinygpt", prompt=prompts[0], max_tokens=12,
                                        temperature=1.0, seed=7)
        params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
        want = Engine(model, tokenizer).generate([tokenizer.encode(prompts[0])], params,
                                                 eos_ids=[eos])[0]
        assert got.choices[0].text == want.text
        chat = client.chat.completions.create(model="tinygpt", max_tokens=5, temperature=0,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].message.content is not None


def test_a_dead_rank_takes_the_server_down_with_a_message(tmp_path):
    """(--threads 2: every rank runs that many torch threads, the workers too.)"""
    log = tmp_path / "server.log"
    with running_server("--threads", "2", "--tensor-parallel-size", "2", env=ENV,
                        log=log) as (url, proc):
        ranks = [p for p in _descendants(proc.pid) if _is_rank(p)]
        assert ranks, "no rank process found below the server"
        os.kill(ranks[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() == 1, "the server kept running (or hung) after a rank died"
        out = log.read_text(errors="replace")
        assert "tensor-parallel rank 1 exited" in out
        for rank in (0, 1):
            assert f"tensor-parallel rank {rank} of 2 ready (2 torch threads)" in out, out


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tinygpt", "serve", "--tensor-parallel-size",
                           "3"], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 2
    assert "must divide n_heads (4)" in done.stderr


STALL_SERVER = """
import sys
import tinygpt.parallel.serving as serving
from tinygpt.server.cli import main
serving.STEP_TIMEOUT_S = 5.0         # the bound, shortened for the test (120 s when served)
sys.exit(main(["--threads", "1", "--tensor-parallel-size", "2", "--port", "0"]))
"""


def test_a_stalled_rank_takes_the_server_down_with_a_message(tmp_path):
    """A stopped rank (SIGSTOP) makes every rank wait in the step's collectives: rank 0's
    watchdog stops the server once the step outlasts the bound, instead of hanging."""
    import re
    import subprocess
    import sys
    import threading
    import urllib.request

    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", STALL_SERVER], stdout=out,
                                stderr=subprocess.STDOUT, env=ENV)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "serving" not in log.read_text() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        assert port, log.read_text()
        ranks = [p for p in _descendants(proc.pid) if _is_rank(p)]
        assert ranks, "no rank process found below the server"
        os.kill(ranks[0], signal.SIGSTOP)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port.group(1)}/v1/completions", method="POST",
            data=b'{"model": "tinygpt", "prompt": "Once upon", "max_tokens": 5}',
            headers={"content-type": "application/json"})

        def ask() -> None:
            try:
                urllib.request.urlopen(request, timeout=60).read()
            except OSError:
                pass                    # the server goes down under it: expected

        threading.Thread(target=ask, daemon=True).start()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the server kept waiting for the stopped rank")
        assert proc.returncode == 1
        assert "a tensor-parallel step has not finished after" in log.read_text()
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
