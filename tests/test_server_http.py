"""HTTP at the server's edge, through real sockets: a client that leaves in the middle of its body
and a malformed chunked body (no traceback in the log, no 500 in /metrics, the server keeps
serving), Content-Type and Content-Encoding (415), header blocks at the 64 KiB bound (431), a
request line h11 cannot parse (a JSON 400; both counted in /metrics), and /v1/models/{id} for
an unknown model. One server process for the module, its log in a file the tests read; plus an
app in process for the count of a 500."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.test_server import client
from tinygpt.bench.load import running_server
from tinygpt.server.limits import MAX_HEADER_BYTES

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

BODY = json.dumps({"model": "tinygpt", "prompt": "The cat", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the base URL, the server's log file)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        with running_server("--threads", "1", env=env, log=log) as (url, _):
            yield url, log
    except RuntimeError as err:
        pytest.fail(str(err))


def exchange(url: str, *parts: bytes, pause: float = 0.0, timeout: float = 30) -> bytes:
    """Send parts on a new connection (pause seconds apart) and read until the server closes."""
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=timeout) as sock:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause)
            sock.sendall(part)
        answer = b""
        while part := sock.recv(65536):
            answer += part
    return answer


def send_and_leave(url: str, data: bytes) -> None:
    """Send data on a new connection and close it without reading."""
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(data)


def json_error(answer: bytes) -> tuple[str, dict]:
    """(the status line, the error object) of a raw HTTP answer with a JSON body."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    return head.split(b"\r\n")[0].decode(), json.loads(body).get("error")


def counted(url: str, path: str) -> dict[str, float]:
    """/metrics' HTTP responses for path, by status."""
    found = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'tinygpt_http_requests_total{{path="{path}",status="'):
            found[line.split('status="')[1].split('"')[0]] = float(line.split()[-1])
    return found


def assert_still_serving(url: str, log) -> None:
    """The log holds no traceback, and a request through the openai client is served."""
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
    reply = client(url).completions.create(model="tinygpt", prompt="The", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_client_that_leaves_mid_body_is_no_server_error(served):
    url, log = served
    before = counted(url, "/v1/completions")
    send_and_leave(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                        b'\r\n{"prompt":')    # 10 of the 100 bytes, then the client closes
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:          # the server's one line, or its traceback
        text = log.read_text(errors="replace")
        if "closed its connection" in text or "Traceback" in text:
            break
        time.sleep(0.1)
    assert text.count("closed its connection after 10 bytes") == 1, text[-3000:]
    after = counted(url, "/v1/completions")
    assert after.get("499", 0) == before.get("499", 0) + 1, after
    assert after.get("500", 0) == before.get("500", 0), after
    assert_still_serving(url, log)


@pytest.mark.parametrize("pause", [0.0, 0.3], ids=["in one write", "the bad chunk later"])
def test_a_malformed_chunked_body_is_a_json_400(served, pause):
    url, log = served
    parts = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n5\r\n" + BODY[:5] + b"\r\n", b"zz\r\n")
    answer = exchange(url, *parts, pause=pause) if pause else exchange(url, b"".join(parts))
    status, error = json_error(answer)        # and the connection closed after it
    assert status == "HTTP/1.1 400 Bad Request", answer[:300]
    assert error["param"] == "Transfer-Encoding" and "chunk" in error["message"], error
    assert "500" not in counted(url, "/v1/completions")
    assert_still_serving(url, log)


def test_a_request_line_h11_cannot_parse_is_a_json_400(served):
    url, log = served
    before = counted(url, "other").get("400", 0)
    status, error = json_error(exchange(url, b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n"))
    assert status == "HTTP/1.1 400 Bad Request" and "not valid HTTP" in error["message"], error
    assert counted(url, "other").get("400", 0) == before + 1    # answered before the app
    assert_still_serving(url, log)


JSON_TYPES = ["application/json", "application/json; charset=utf-8",
              "Application/JSON;Charset=UTF-8", "application/vnd.api+json", None]
OTHER_TYPES = ["text/plain", "application/x-www-form-urlencoded", "application/jsonx",
               "multipart/form-data; boundary=x", "json", ""]


@pytest.mark.parametrize("media", JSON_TYPES)
def test_json_bodies_are_served_with_or_without_a_content_type(served, media):
    url, _ = served
    headers = {} if media is None else {"Content-Type": media}
    response = httpx.post(f"{url}/v1/completions", content=BODY, headers=headers, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("media", OTHER_TYPES)
def test_other_content_types_are_a_415_naming_what_to_send(served, media):
    url, _ = served
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        response = httpx.post(f"{url}{path}", content=BODY, headers={"Content-Type": media})
        assert response.status_code == 415, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == "Content-Type" and repr(media) in error["message"], error
        assert "-H 'Content-Type: application/json'" in error["message"], error


@pytest.mark.parametrize(("encoding", "status"), [("gzip", 415), ("identity", 200),
                                                  ("br, identity", 415), ("IDENTITY", 200)])
def test_a_content_encoding_other_than_identity_is_a_415(served, encoding, status):
    url, _ = served
    response = httpx.post(f"{url}/v1/completions", content=BODY, timeout=60,
                          headers={"Content-Type": "application/json",
                                   "Content-Encoding": encoding})
    assert response.status_code == status, response.text
    if status == 415:
        assert response.json()["error"]["param"] == "Content-Encoding"
        assert response.headers["accept-encoding"] == "identity"


def header_block(size: int) -> bytes:
    """A GET /health whose request line and headers are `size` bytes, the blank line included."""
    start = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


def test_header_blocks_up_to_64_kib_are_served_and_longer_ones_are_a_431(served):
    url, log = served
    assert MAX_HEADER_BYTES == 64 * 1024              # the README's number
    at_bound = header_block(MAX_HEADER_BYTES)
    assert len(at_bound) == MAX_HEADER_BYTES
    assert exchange(url, at_bound).startswith(b"HTTP/1.1 200 OK")
    over = header_block(MAX_HEADER_BYTES + 1)
    before = counted(url, "other").get("431", 0)
    for what, parts in (("one byte over, in one write", (over,)),
                        ("one byte over, in two writes", (over[:40_000], over[40_000:])),
                        ("200 KB", (header_block(200_000),)),
                        ("2 MB in one write", (header_block(2_000_000),))):
        answer = exchange(url, *parts, pause=0.2)
        status, error = json_error(answer)
        assert status == "HTTP/1.1 431 Request Header Fields Too Large", (what, answer[:300])
        assert str(MAX_HEADER_BYTES) in error["message"], (what, error)
    assert counted(url, "other").get("431", 0) == before + 4    # answered before the app
    assert_still_serving(url, log)


def test_an_unknown_model_is_openai_s_404(served):
    url, _ = served
    response = httpx.get(f"{url}/v1/models/nope")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "the model 'nope' is not served here; this server serves 'tinygpt'",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert httpx.get(f"{url}/v1/models/tinygpt").json()["id"] == "tinygpt"


def test_a_crash_s_500_is_counted_in_metrics():
    """Starlette answers a crash outside the app's middleware; the count must still see it."""
    from tinygpt import load_pretrained
    from tinygpt.engine import AsyncEngine
    from tinygpt.server import create_app

    model, tokenizer = load_pretrained()

    async def run() -> tuple[int, str]:
        engine = AsyncEngine(model.eval(), tokenizer)
        app = create_app(engine, tokenizer, model.cfg.max_seq_len)

        def broken():
            raise RuntimeError("a bug")

        app.state.served.prompts.info = broken
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://tinygpt") as http:
            status = (await http.get("/tokenizer_info")).status_code
            metrics = (await http.get("/metrics")).text
        await engine.shutdown(1.0)
        return status, metrics

    status, metrics = asyncio.run(run())
    assert status == 500
    assert 'tinygpt_http_requests_total{path="/tokenizer_info",status="500"} 1.0' in metrics


def test_running_totals_are_counters_and_the_rest_of_the_stats_gauges():
    """Preemptions and the prefix cache's queries and hits only grow: Prometheus counters
    (NAME_total); what goes up and down is a gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    from tinygpt.engine import EngineStats
    from tinygpt.server.metrics import Metrics

    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats(running=1, waiting=2, submitted=9, finished=6, cancelled=0,
                               rejected=0, tokens_generated=40, max_waiting=64,
                               kv_blocks_used=3, kv_blocks_total=40, preemptions=5,
                               prefix_cached_blocks=4, prefix_query_tokens=100,
                               prefix_hit_tokens=30)

    families = {family.name: family
                for family in text_string_to_metric_families(Metrics(Engine()).text()[0])}
    for name, value in (("tinygpt_preemptions", 5), ("tinygpt_prefix_cache_queries", 100),
                        ("tinygpt_prefix_cache_hits", 30)):
        assert families[name].type == "counter", name
        assert [(s.name, s.value) for s in families[name].samples] == [(f"{name}_total", value)]
    for name, value in (("tinygpt_requests_running", 1), ("tinygpt_requests_waiting", 2),
                        ("tinygpt_kv_blocks_used", 3), ("tinygpt_kv_blocks_total", 40),
                        ("tinygpt_prefix_cache_blocks", 4),
                        ("tinygpt_prefix_cache_hit_rate", 0.3)):
        assert families[name].type == "gauge", name
        assert [(s.name, s.value) for s in families[name].samples] == [(name, value)]
