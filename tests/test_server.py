"""`python -m tinygpt serve` driven from outside, as users drive it: the official `openai`
client (completions and chat, streaming and not, several clients at once) and raw HTTP for the
error cases, overload, a client that disconnects mid-stream, and SIGTERM. Each server runs as
its own process on a free loopback port with the shipped checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import torch

from tinygpt import load_pretrained
from tinygpt.bench.load import running_server
from tinygpt.generate import generate
from tinygpt.sampling import SamplingParams

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@contextmanager
def server(*args: str):
    try:
        with running_server("--threads", "1", *args,
                            env=dict(os.environ, OMP_NUM_THREADS="1")) as (url, proc):
            yield url, proc
    except RuntimeError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="module")
def served():
    with server("--max-queue", "16") as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference():
    model, tokenizer = load_pretrained()
    return model, tokenizer


def client(url: str):
    # a timeout well above any request here, so that a server that stops answering fails the
    # test instead of holding make test until CI's limit
    return openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0,
                         timeout=60)


def test_completions_with_the_openai_client_match_batch_one_generate(served, reference):
    model, tokenizer = reference
    got = client(served).completions.create(model="tinygpt", prompt="The cat sat on the",
                                            max_tokens=20, temperature=0)
    want = generate(model, tokenizer.encode("The cat sat on the"),
                    SamplingParams(temperature=0, max_new_tokens=20),
                    eos_id=tokenizer.special_tokens["<|endoftext|>"], tokenizer=tokenizer)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == ("length" if want.stop_reason == "length" else "stop")
    assert got.usage.prompt_tokens == len(want.prompt_ids)
    assert got.usage.completion_tokens == len(want.token_ids)


def test_streamed_completion_equals_the_whole_one(served):
    c = client(served)
    whole = c.completions.create(model="tinygpt", prompt="Once upon a time", max_tokens=30,
                                 temperature=0.8, seed=11)
    chunks = list(c.completions.create(model="tinygpt", prompt="Once upon a time",
                                       max_tokens=30, temperature=0.8, seed=11, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_completions_streamed_and_not(served):
    c = client(served)
    messages = [{"role": "user", "content": "Tell me about the dog."}]
    whole = c.chat.completions.create(model="tinygpt", messages=messages, max_tokens=25,
                                      temperature=0)
    assert whole.choices[0].message.role == "assistant"
    parts = list(c.chat.completions.create(model="tinygpt", messages=messages, max_tokens=25,
                                           temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in parts)
    assert text == whole.choices[0].message.content


def test_the_openai_client_gets_n_choices_logprobs_and_echo(served):
    c = client(served)
    two = c.completions.create(model="tinygpt", prompt="Once upon a time", max_tokens=8, n=2,
                               seed=7, temperature=1.0, extra_body={"ignore_eos": True})
    again = c.completions.create(model="tinygpt", prompt="Once upon a time", max_tokens=8,
                                 seed=8, temperature=1.0, extra_body={"ignore_eos": True})
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[1].text == again.choices[0].text          # choice 1 used seed 7 + 1
    echoed = c.completions.create(model="tinygpt", prompt="The cat sat", max_tokens=3,
                                  temperature=0, echo=True, logprobs=2)
    logprobs = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("The cat sat")
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len(
        logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset)
    scored = c.completions.create(model="tinygpt", prompt="The cat sat", max_tokens=0,
                                  echo=True, logprobs=2)                 # the prompt alone
    assert scored.choices[0].text == "The cat sat" and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == logprobs.token_logprobs[
        1:len(scored.choices[0].logprobs.tokens)]
    chat = c.chat.completions.create(
        model="tinygpt", messages=[{"role": "developer", "content": "Be kind."},
                                   {"role": "user", "content": [{"type": "text",
                                                                 "text": "Hello"}]}],
        max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        response_format={"type": "text"}, store=False, metadata={"run": "test"}, user="u")
    content = chat.choices[0].logprobs.content
    assert content and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob <= 0 for entry in content)


def test_several_clients_at_once(served):
    prompts = ["The dog", "A bird", "The cat", "Once upon a time", "The mat", "A girl"]

    def ask(prompt: str) -> str:
        return client(served).completions.create(model="tinygpt", prompt=prompt,
                                                 max_tokens=15, temperature=0).choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone, "a request's output depended on what ran beside it"


def test_the_server_keeps_answering_past_a_pipe_full_of_access_log(served):
    # uvicorn logs a line per request; running_server once piped the server's output without
    # reading it, and after about 1,100 requests the server blocked writing its log (seen as
    # a completion that never answered, late in this module)
    with httpx.Client(timeout=10) as http:
        for _ in range(1500):
            assert http.get(f"{served}/health").status_code == 200


def test_models_health_and_metrics(served):
    # this test's own request, so the counters below do not depend on which tests ran before it
    # on this xdist worker (each worker starts its own server)
    client(served).completions.create(model="tinygpt", prompt="Hi", max_tokens=2, temperature=0)
    assert [m.id for m in client(served).models.list().data] == ["tinygpt"]
    health = httpx.get(f"{served}/health").json()
    # the engine counts a request finished, and frees it, before its answer is sent
    assert health["status"] == "ok" and health["finished"] >= 1
    assert health["running"] == health["waiting"] == 0, health
    metrics = httpx.get(f"{served}/metrics").text
    for name in ("tinygpt_generated_tokens_total", "tinygpt_requests_running",
                 "tinygpt_time_to_first_token_seconds_bucket", "tinygpt_queue_seconds_count",
                 "tinygpt_kv_blocks_used", "tinygpt_kv_blocks_total", "tinygpt_preemptions",
                 'tinygpt_http_requests_total{path="/v1/completions",status="200"}'):
        assert name in metrics, name


def test_metrics_count_no_token_for_an_echo_that_generates_none(served):
    # max_tokens 0 with echo scores the prompt: the engine generates one token to do so, which
    # the reply drops and its usage does not count; the metrics must agree with the usage
    from prometheus_client.parser import text_string_to_metric_families

    def counted() -> tuple[float, float, float]:
        samples = {sample.name: sample.value for family in text_string_to_metric_families(
            httpx.get(f"{served}/metrics").text) for sample in family.samples}
        return (samples["tinygpt_generated_tokens_total"],
                samples["tinygpt_time_to_first_token_seconds_count"],
                samples["tinygpt_queue_seconds_count"])

    before = counted()
    for logprobs in (None, 1):
        scored = client(served).completions.create(model="tinygpt", prompt="The cat sat",
                                                   max_tokens=0, echo=True, logprobs=logprobs)
        assert scored.usage.completion_tokens == 0
    tokens, ttfts, queued = counted()
    assert (tokens, ttfts) == before[:2] and queued == before[2] + 2
    two = client(served).completions.create(model="tinygpt", prompt="Hi", max_tokens=2,
                                            temperature=0, echo=True, logprobs=1)
    after = counted()
    assert after[0] == tokens + two.usage.completion_tokens and after[1] == ttfts + 1


BAD = [
    ("malformed JSON", b"{not json", 400, None),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("non-numeric temperature", {"model": "tinygpt", "prompt": "x", "temperature": "hot"},
     422, "temperature"),
    ("negative temperature", {"model": "tinygpt", "prompt": "x", "temperature": -1}, 400,
     "temperature"),
    ("top_p zero", {"model": "tinygpt", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"model": "tinygpt", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("max_tokens past the context", {"model": "tinygpt", "prompt": "x", "max_tokens": 5000},
     400, "max_tokens"),
    ("zero max_tokens", {"model": "tinygpt", "prompt": "x", "max_tokens": 0}, 400,
     "max_tokens"),
    ("over-long prompt", {"model": "tinygpt", "prompt": list(range(5, 405)) * 3}, 400,
     "prompt"),
    ("empty prompt", {"model": "tinygpt", "prompt": ""}, 400, "prompt"),
    ("token id out of range", {"model": "tinygpt", "prompt": [1, 99999]}, 400, "prompt"),
    ("unsupported field", {"model": "tinygpt", "prompt": "x", "frobnicate": 2}, 400,
     "frobnicate"),
    ("n too large", {"model": "tinygpt", "prompt": "x", "n": 1000}, 400, "n"),
    ("missing prompt", {"model": "tinygpt"}, 422, "prompt"),
]


@pytest.mark.parametrize(("what", "body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_style_errors(served, what, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{served}/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, (what, response.text)
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param, error


def test_bad_chat_messages_and_unknown_paths(served):
    bad_role = {"model": "tinygpt", "messages": [{"role": "wizard", "content": "hi"}]}
    response = httpx.post(f"{served}/v1/chat/completions", json=bad_role)
    assert response.status_code == 400 and "role" in response.json()["error"]["message"]
    assert httpx.get(f"{served}/v1/nothing").status_code == 404
    # and after all of that, a good request is still served
    ok = client(served).completions.create(model="tinygpt", prompt="The", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def wait_for(url: str, condition, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health").json()
        if condition(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_a_disconnecting_client_has_its_request_cancelled(served):
    before = httpx.get(f"{served}/health").json()
    body = {"model": "tinygpt", "prompt": "The", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{served}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(3)]
        assert seen[0].startswith("data: ")
    health = wait_for(served, lambda h: h["cancelled"] > before["cancelled"]
                      and h["running"] == 0)
    assert health["cancelled"] == before["cancelled"] + 1 and health["running"] == 0
    assert health["kv_blocks_used"] == 0, "the cancelled request still holds KV blocks"
    assert health["kv_blocks_total"] > 0
    generated = health["tokens_generated"] - before["tokens_generated"]
    assert generated < 1000, "the request ran to the end after its client left"


def test_a_client_that_hangs_up_before_a_whole_reply_has_its_choices_cancelled(served):
    """Not streamed, nothing tells the server the client left until it writes the reply: the
    choices ran to max_tokens holding their slots and KV blocks (a fire-and-forget client
    could fill the queue). The hang-up is read while the reply is made."""
    import socket
    from urllib.parse import urlsplit

    before = httpx.get(f"{served}/health").json()
    body = json.dumps({"model": "tinygpt", "prompt": "The", "max_tokens": 1000,
                       "ignore_eos": True, "n": 2}).encode()
    address = urlsplit(served)
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        started = wait_for(served, lambda h: h["submitted"] >= before["submitted"] + 2)
        assert started["submitted"] == before["submitted"] + 2
    health = wait_for(served, lambda h: h["cancelled"] >= before["cancelled"] + 2
                      and h["running"] == 0)
    assert health["cancelled"] == before["cancelled"] + 2 and health["running"] == 0
    assert health["kv_blocks_used"] == 0, "the abandoned choices still hold KV blocks"
    generated = health["tokens_generated"] - before["tokens_generated"]
    assert generated < 2000, "the choices ran to the end after their client left"


def test_a_full_queue_answers_429_and_keeps_serving():
    with server("--max-queue", "1", "--max-running", "1") as (url, _):
        body = {"model": "tinygpt", "prompt": "The", "max_tokens": 400, "ignore_eos": True}

        def post(_):
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code

        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(post, range(6)))
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
        stats = httpx.get(f"{url}/health").json()
        assert stats["rejected"] == codes.count(429) and stats["waiting"] == 0
        again = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 5}, timeout=60)
        assert again.status_code == 200
        assert httpx.post(f"{url}/v1/completions", content=b"{oops",
                          headers={"content-type": "application/json"}).status_code == 400


def test_sigterm_ends_in_flight_requests_cleanly_and_exits():
    with server("--grace", "1") as (url, proc):
        body = {"model": "tinygpt", "prompt": "The", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)          # the stream must end, finished or cut, not hang
        assert proc.wait(timeout=30) == 0
        data = [line for line in rest if line]
        assert all(line.startswith("data: ") for line in data)
        assert data[-1] == "data: [DONE]" or "shutting down" in data[-1], data[-1:]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)


def test_large_requests_do_not_stall_a_running_stream():
    """Parsing and the length checks run off the event loop: the gaps between a stream's
    tokens stay within 100 ms of their usual size while a 10 MB text prompt (the body limit
    raised to let it in) and a megabyte of token ids are refused. A server that blocked its
    loop would stall every try by seconds; a busy machine stalls some tries by chance, so each
    request gets up to three tries and one of them must stay within the bound."""
    big_text = json.dumps({"model": "tinygpt", "prompt": "word " * (2 * 2**20)}).encode()
    many_ids = json.dumps({"model": "tinygpt", "prompt": [7] * 330_000}).encode()
    assert len(big_text) > 10 * 2**20 and 2**20 - 2**16 < len(many_ids) < 2**20
    tries = 3
    with server("--max-body-bytes", str(16 * 2**20)) as (url, _):
        body = {"model": "tinygpt", "prompt": "The", "max_tokens": 1000, "ignore_eos": True,
                "stream": True, "temperature": 0}
        times: list[float] = []
        worst: dict[str, float] = {}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: {"))
            for _ in range(60):
                next(lines)
                times.append(time.perf_counter())
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            usual = max(gaps)               # the longest gap before (a shared machine has some)
            with ThreadPoolExecutor(1) as pool:
                for content, name in ((big_text, "10 MB of text"),
                                      (many_ids, "1 MB of token ids")):
                    for _ in range(tries):
                        sent = time.perf_counter()
                        future = pool.submit(httpx.post, f"{url}/v1/completions",
                                             content=content,
                                             headers={"content-type": "application/json"},
                                             timeout=60)
                        window = [times[-1]]
                        while not future.done() or window[-1] < time.perf_counter() - 0.3:
                            next(lines)
                            window.append(time.perf_counter())
                        times.extend(window[1:])
                        answer = future.result()
                        assert answer.status_code == 400, answer.text
                        assert answer.json()["error"]["code"] == "context_length_exceeded"
                        during = [b - a for a, b in zip(window, window[1:], strict=False)
                                  if b >= sent]
                        worst[name] = max(during)
                        if worst[name] < usual + 0.1:
                            break
    for name, gap in worst.items():
        assert gap < usual + 0.1, (f"{name}: the stream's longest gap was {gap:.3f} s in each "
                                   f"of {tries} tries, against {usual:.3f} s before")


def test_poisson_arrivals_are_seeded_with_the_right_mean_gap():
    from tinygpt.bench.load import plan_requests

    plan = plan_requests(2000, rate=4.0, seed=3)
    assert plan == plan_requests(2000, rate=4.0, seed=3)
    gaps = [b.at - a.at for a, b in zip(plan, plan[1:], strict=False)]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02      # 1 / rate, within ~3 standard errors
    with pytest.raises(ValueError, match="rate"):
        plan_requests(3, rate=0)


def test_the_load_generator_measures_a_running_server(served, tmp_path):
    from tinygpt.bench.load import format_reports, main, run_load

    report = run_load(served, rate=20.0, n=6, mix=((8, 6, 1),), seed=1)
    assert report["ok"] == 6 and not report["failed"], report["failed"]
    assert 1 <= report["metrics"]["e2e_s"]["n"] == 6
    assert report["output_tokens_per_s"] > 0 and report["goodput_rps"] >= 0
    assert "goodput" in format_reports([report])
    out = tmp_path / "load.json"
    assert main(["--url", served, "--rates", "10", "--requests", "3", "--json", str(out),
                 "--plot", str(tmp_path / "load.png")]) == 0
    assert json.loads(out.read_text())[0]["ok"] == 3 and (tmp_path / "load.png").stat().st_size
    assert main(["--url", served, "--rates", "0"]) == 2


def test_the_serial_engine_serves_the_same_text(reference):
    model, tokenizer = reference
    with server("--engine", "serial") as (url, _):
        got = client(url).completions.create(model="tinygpt", prompt="A dog", max_tokens=15,
                                             temperature=0)
        health = httpx.get(f"{url}/health").json()
    want = generate(model, tokenizer.encode("A dog"), SamplingParams(temperature=0,
                    max_new_tokens=15), eos_id=tokenizer.special_tokens["<|endoftext|>"],
                    tokenizer=tokenizer)
    assert got.choices[0].text == want.text
    assert health["kv_blocks_total"] == 0          # no paged pool behind the serial engine


def test_stalled_clients_are_cut_off_and_no_prefix_caching_turns_the_cache_off():
    """Headers that never finish: the connection is closed; a body that stalls: 408; a
    pipelined request that runs longer than the header timeout is answered whole. (The same
    server runs with --no-prefix-caching: one server start for all.)"""
    import socket
    from urllib.parse import urlparse

    prompt = "Once upon a time there was a girl named Lily who loved her red ball. " * 3
    with server("--header-timeout", "0.5", "--body-timeout", "1", "--no-prefix-caching") as (
            url, _):
        for _ in range(2):
            client(url).completions.create(model="tinygpt", prompt=prompt, max_tokens=2)
        health = httpx.get(f"{url}/health").json()
        assert health["prefix_hit_tokens"] == 0 and health["prefix_query_tokens"] > 0
        assert health["prefix_cached_blocks"] == 0
        where = urlparse(url)
        with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # and no more
            start = time.monotonic()
            assert sock.recv(1024) == b""              # the server closed the connection
            assert time.monotonic() - start < 5
        with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"model": ')                # 10 of the 100 bytes, then nothing
            answer = b""
            while b'"request_timeout"' not in answer:   # the headers, then the body
                part = sock.recv(4096)
                if not part:
                    break
                answer += part
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"request_timeout"' in answer
        # two requests in one write (HTTP/1.1 pipelining); the second one's headers are in
        # before the first is answered, so no header timer may run while it generates (one
        # armed with it once closed the connection half a second into its answer)
        body = json.dumps({"model": "tinygpt", "prompt": "Once upon a time", "n": 8,
                           "max_tokens": 600, "temperature": 1.0, "seed": 1,
                           "ignore_eos": True}).encode()
        with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            answer = b""
            while not (b'"completion_tokens":4800' in answer and answer.endswith(b"}")):
                part = sock.recv(65536)
                if not part:
                    break
                answer += part
            took = time.monotonic() - start
        assert answer.count(b"HTTP/1.1 200 OK") == 2, (took, answer[-300:])
        assert took > 0.5, "the answer came before the header timeout: this proved nothing"
        assert httpx.get(f"{url}/health").status_code == 200


def test_bad_engine_flags_are_refused():
    from tinygpt.server import main
    assert main(["--max-running", "0"]) == 2
    assert main(["--token-budget", "-1"]) == 2
    assert main(["--max-body-bytes", "0"]) == 2
    assert main(["--header-timeout", "0"]) == 2
    assert main(["--quantize", "int3"]) == 2


def test_a_quantized_model_is_served(reference):
    from tinygpt.quant import quantize_model

    model, tokenizer = reference
    want = generate(quantize_model(model, "int8"), tokenizer.encode("A dog"),
                    SamplingParams(temperature=0, max_new_tokens=15),
                    eos_id=tokenizer.special_tokens["<|endoftext|>"], tokenizer=tokenizer)
    with server("--quantize", "int8") as (url, _):
        got = client(url).completions.create(model="tinygpt", prompt="A dog", max_tokens=15,
                                             temperature=0)
    assert got.choices[0].text == want.text


def hf_llama_folder(path):
    """A tiny random Llama saved the Hugging Face way (config.json, model.safetensors) with a
    word-level tokenizer and a chat template, all written locally."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran",
             "user", "assistant", ":"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")            # joins words with spaces
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                               bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                         "{% endfor %}assistant :")
    config = transformers.LlamaConfig(vocab_size=len(words), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=2,
                                      bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return tok


def test_a_hugging_face_llama_folder_is_served(tmp_path):
    from tinygpt.loading import load_model

    tok = hf_llama_folder(tmp_path)
    model, tokenizer, info = load_model(tmp_path)
    assert info.model_id == tmp_path.name           # served under the folder's name
    prompt = "the cat sat on"
    want = generate(model, tokenizer.encode(prompt), SamplingParams(temperature=0,
                    max_new_tokens=6), tokenizer=tokenizer)
    with server("--model", str(tmp_path)) as (url, _):
        got = client(url).completions.create(model=info.model_id, prompt=prompt, max_tokens=6,
                                             temperature=0, extra_body={"ignore_eos": True})
        chat = client(url).chat.completions.create(
            model=info.model_id, messages=[{"role": "user", "content": "a dog ran"}], max_tokens=3,
            temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(tok.encode(prompt))
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tokenizer.encode_chat(
        [{"role": "user", "content": "a dog ran"}]))


def test_a_folder_without_safetensors_is_refused(tmp_path):
    from tinygpt.loading import load_model
    from tinygpt.server import main

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    assert main(["--model", str(tmp_path / "nowhere")]) == 2


def test_a_request_the_kv_pool_cannot_hold_is_a_400_and_others_are_served():
    with server("--kv-blocks", "4") as (url, _):      # 4 blocks of 16: at most 64 positions
        too_big = httpx.post(f"{url}/v1/completions", json={
            "model": "tinygpt", "prompt": "The", "max_tokens": 200})
        fits = httpx.post(f"{url}/v1/completions", json={
            "model": "tinygpt", "prompt": "The", "max_tokens": 20}, timeout=60)
    assert too_big.status_code == 400, too_big.text
    error = too_big.json()["error"]
    assert error["param"] == "max_tokens" and "--kv-blocks raises the pool" in error["message"]
    assert fits.status_code == 200


# -- tiny temperatures, streams that fail, text offsets and bytes, big responses ---------------


def completion_stream(url: str, path: str, body: dict) -> list[str]:
    """The data lines of a streamed request, in order."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def streamed_text(lines: list[str], chat: bool) -> str:
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"] for line in lines[:-1]]
    return "".join((c[0]["delta"].get("content") or "") if chat else c[0]["text"]
                   for c in chunks if c)


@pytest.mark.parametrize("temperature", [1e-38, 3e-38, 1e-45, 1e-300, 5e-324])
def test_a_tiny_temperature_answers_the_greedy_tokens(served, temperature):
    # logits / 1e-38 overflowed float32 and the server answered 500 "logits must not contain
    # NaN or +inf"; the limit of sampling as T -> 0 is the argmax
    for path, body, chat in (
            ("/v1/completions", {"prompt": "The cat"}, False),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, True)):
        body = {"model": "tinygpt", "max_tokens": 8, "ignore_eos": True, **body}
        texts = []
        for t in (0, temperature):
            answer = httpx.post(f"{served}{path}", json={**body, "temperature": t}, timeout=60)
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            texts.append(choice["message"]["content"] if chat else choice["text"])
            lines = completion_stream(served, path, {**body, "temperature": t})
            texts.append(streamed_text(lines, chat))
        assert texts == [texts[0]] * 4, (path, texts)


def test_text_offsets_count_whole_characters_before_each_token(served, reference):
    # "é中x" is five byte tokens (each shown as U+FFFD), then "x"; text_offset once counted
    # each byte token's U+FFFD as a character, putting "x" at 5 in "é中x the house"
    _, tokenizer = reference
    body = {"model": "tinygpt", "prompt": "é中x", "max_tokens": 2, "echo": True,
            "logprobs": 0, "temperature": 0}
    assert tokenizer.encode("é中x")[:5] == list(b"\xc3\xa9\xe4\xb8\xad")
    choice = httpx.post(f"{served}/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert logprobs["text_offset"][:6] == [0, 0, 1, 1, 1, 2]
    for token, offset in zip(logprobs["tokens"][5:], logprobs["text_offset"][5:], strict=True):
        assert text[offset:offset + len(token)] == token, (text, logprobs)
    lines = completion_stream(served, "/v1/completions", body)
    streamed = [json.loads(line)["choices"][0]["logprobs"] for line in lines[:-1]]
    assert sum((part["text_offset"] for part in streamed), []) == logprobs["text_offset"]
    alone = httpx.post(f"{served}/v1/completions", json={**body, "echo": False},
                       timeout=60).json()["choices"][0]["logprobs"]
    assert alone["text_offset"] == logprobs["text_offset"][6:]      # after the 3 characters
    # a prompt that ends inside a character: its bytes stay at 0, and the reply starts after
    # the U+FFFD the cut character shows as
    cut = {**body, "prompt": [72, 0xe4, 0xb8], "max_tokens": 1}
    cut_choice = httpx.post(f"{served}/v1/completions", json=cut, timeout=60).json()["choices"][0]
    assert cut_choice["text"].startswith("H\ufffd")
    assert cut_choice["logprobs"]["text_offset"] == [0, 1, 1, 2]


class InProcess:
    """The server's app over an AsyncEngine in this process (httpx's ASGI transport, no
    sockets), and an event loop to call it on: for tests that patch the server's code."""

    def __init__(self, model, tokenizer) -> None:
        import asyncio

        from tinygpt.engine import AsyncEngine
        from tinygpt.server import create_app

        self.loop = asyncio.new_event_loop()
        self.engine = AsyncEngine(model, tokenizer, max_waiting=16)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(self.engine, tokenizer,
                                                         model.cfg.max_seq_len)),
            base_url="http://tinygpt", timeout=60)

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post(path, json=body))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.engine.shutdown(1.0))
        self.loop.close()


@pytest.fixture(scope="module")
def random_model(reference):
    """The shipped tokenizer over a random 2-layer model: its most likely tokens include byte
    tokens, which the trained model's seldom do."""
    from tinygpt.model import ModelConfig, TinyGPT

    _, tokenizer = reference
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=64, max_seq_len=128)
    model = TinyGPT(cfg).eval()
    app = InProcess(model, tokenizer)
    yield app, model, tokenizer
    app.close()


def test_logprob_bytes_are_the_tokens_own_and_shared_keys_keep_the_most_probable(
        random_model):
    app, model, tokenizer = random_model
    vocab_bytes = {tokenizer.token_bytes([i])[0] for i in range(tokenizer.vocab_size)}
    chat = app.post("/v1/chat/completions", {
        "model": "tinygpt", "messages": [{"role": "user", "content": "é中x"}],
        "max_tokens": 6, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
        "temperature": 0}).json()["choices"][0]["logprobs"]["content"]
    entries = chat + [alt for entry in chat for alt in entry["top_logprobs"]]
    assert any(entry["token"] == "\ufffd" for entry in entries)      # byte tokens were met
    for entry in entries:
        # a byte token's bytes once were the UTF-8 of U+FFFD (239, 191, 189)
        assert bytes(entry["bytes"]) in vocab_bytes, entry
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    # completions' top_logprobs are keyed by text: byte tokens share "\ufffd", which keeps
    # the most probable of them
    ids = tokenizer.encode("The cat sat on the mat. é中x")
    scored = app.post("/v1/completions", {"model": "tinygpt", "prompt": ids, "max_tokens": 0,
                                          "echo": True, "logprobs": 20}).json()
    tops = scored["choices"][0]["logprobs"]["top_logprobs"]
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    shared = 0
    for position, top in enumerate(tops[1:]):
        values, order = logp[position].topk(20)
        byte_values = [v for v, i in zip(values.tolist(), order.tolist(), strict=True)
                       if tokenizer.decode([i]) == "\ufffd"]
        if len(byte_values) >= 2:
            shared += 1
            assert top["\ufffd"] == pytest.approx(max(byte_values), abs=1e-4), (position, top)
    assert shared > 0


def test_a_stream_that_fails_midway_still_ends_with_done(random_model, monkeypatch):
    # the engine fails a request when its sampling loop raises; the stream then sent its error
    # event and stopped, and clients that wait for "data: [DONE]" (as vLLM sends it) hung
    import tinygpt.generate

    app, _, _ = random_model
    calls = {"n": 0}
    real = tinygpt.generate.sample_next_token

    def fails_on_the_fourth_token(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("the sampler broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(tinygpt.generate, "sample_next_token", fails_on_the_fourth_token)
    for path, body in (("/v1/completions", {"prompt": "The cat"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "Hi"}]})):
        calls["n"] = 0
        response = app.post(path, {"model": "tinygpt", "max_tokens": 10, "ignore_eos": True,
                                   "stream": True, **body})
        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert "the sampler broke" in error["message"] and error["type"] == "server_error"
        assert calls["n"] == 4 and len(lines) >= 3       # it failed mid-way, after a frame


def built_slowly_beside_health(app, monkeypatch, method: str, body: dict):
    """Post `body` with responses.Choice.<method> made slow (0.5 s, sleeping, so the check
    does not depend on the machine); once it is building, ask for /health. Returns the
    response, and /health's answer with the seconds it took and how long before the building
    ended it came."""
    import asyncio
    import threading

    from tinygpt.server import responses

    building, timeline = threading.Event(), {}
    real = getattr(responses.Choice, method)

    def slow(self):
        building.set()
        time.sleep(0.5)
        timeline["built"] = time.perf_counter()
        return real(self)

    monkeypatch.setattr(responses.Choice, method, slow)

    async def scenario():
        answer = asyncio.create_task(app.client.post("/v1/completions", json=body))
        deadline = time.perf_counter() + 60
        while not building.is_set():
            assert not answer.done(), f"the request ended unbuilt: {answer.result().text[:300]}"
            assert time.perf_counter() < deadline, "the response was not built within 60 s"
            await asyncio.sleep(0.005)
        sent = time.perf_counter()
        health = await app.client.get("/health")
        answered = time.perf_counter()
        return await answer, health, answered - sent, timeline["built"] - answered

    answer, health, took, left = app.loop.run_until_complete(scenario())
    assert health.status_code == 200
    assert took < 0.1 and left > 0, (f"/health took {took:.3f} s and was answered "
                                     f"{-left:.3f} s after the response was built")
    return answer


def test_a_whole_response_is_built_off_the_event_loop(random_model, monkeypatch):
    """A whole response with echo and logprobs over many long prompts is megabytes of JSON;
    built on the event loop, 37 MB of it held /health back for a second: /health must be
    answered within 100 ms while each choice's logprobs are built."""
    whole = built_slowly_beside_health(random_model[0], monkeypatch, "take", {
        "model": "tinygpt", "prompt": "The cat", "max_tokens": 2, "echo": True, "logprobs": 2,
        "n": 2, "seed": 1})
    assert whole.status_code == 200 and len(whole.json()["choices"]) == 2


def test_a_stream_s_echoed_prompt_is_built_off_the_event_loop(random_model, monkeypatch):
    """The same for a stream: its echoed prompt with logprobs (up to 2^18 entries) was built
    and serialized on the event loop."""
    streamed = built_slowly_beside_health(random_model[0], monkeypatch, "prompt_part", {
        "model": "tinygpt", "prompt": "The cat", "max_tokens": 2, "echo": True, "logprobs": 2,
        "seed": 1, "stream": True})
    frames = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert streamed.status_code == 200 and frames[0]["choices"][0]["text"] == "The cat"
    assert frames[0]["choices"][0]["logprobs"]["tokens"], frames[0]
