"""The published API: /openapi.json is a valid OpenAPI 3 document whose request bodies are the
models the endpoints really validate with, /docs works without the internet, and schemathesis,
a schema-driven API fuzzer, run from that document against a live server finds no server error
(nor a response that contradicts the document)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import schemathesis
from jsonschema import Draft202012Validator

from tinygpt.bench.load import free_port, running_server
from tinygpt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

pytestmark = pytest.mark.slow

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


@pytest.fixture(scope="module")
def served():
    with running_server("--threads", "1", env=dict(os.environ, OMP_NUM_THREADS="1")) as (url, _):
        yield url


@pytest.fixture(scope="module")
def document(served) -> dict:
    response = httpx.get(f"{served}/openapi.json")
    assert response.status_code == 200
    return response.json()


def resolve(document: dict, ref: str) -> dict:
    assert ref.startswith("#/components/schemas/"), ref
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_openapi_json_is_a_valid_openapi_3_document(document):
    assert document["openapi"].startswith("3.")
    schemathesis.openapi.from_dict(document).validate()     # the OpenAPI meta-schema
    for _name, schema in document["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)               # each a valid JSON Schema
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                 "/detokenize", "/tokenizer_info", "/health", "/metrics"):
        assert path in document["paths"], path


def test_the_meta_schema_check_can_fail(document):
    broken = copy.deepcopy(document)
    broken["paths"]["/tokenize"]["post"]["responses"] = "none"
    with pytest.raises(Exception, match="(?i)responses|not of type|is not valid"):
        schemathesis.openapi.from_dict(broken).validate()


def test_request_bodies_are_the_models_the_endpoints_validate_with(document):
    for path, model in BODIES.items():
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]
        assert body["required"] is True
        published = resolve(document, body["content"]["application/json"]["schema"]["$ref"])
        assert set(published["properties"]) == set(model.model_fields), path
        required = {name for name, field in model.model_fields.items() if field.is_required()}
        assert set(published.get("required", ())) == required, path
        assert published["additionalProperties"] is False, path    # unknown fields are a 400
        assert {"400", "422", "413"} <= set(operation["responses"]), path
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/Message"}


def test_the_published_body_schemas_agree_with_the_server(document, served):
    """Bodies the document calls invalid get a 4xx; bodies it calls valid (and in range) a 200."""
    cases = [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, 200),
             ("/v1/completions", {"prompt": [[False]], "max_tokens": 2}, 422),
             ("/v1/completions", {"prompt": "Hi", "max_tokens": "2"}, 422),
             ("/v1/completions", {"prompt": "Hi", "colour": "red"}, 400),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 2}, 200),
             ("/v1/chat/completions", {"messages": "Hi"}, 422),
             ("/tokenize", {"prompt": "Hi"}, 200),
             ("/tokenize", {"prompt": "Hi", "messages": []}, 400),
             ("/tokenize", {}, 400),
             ("/detokenize", {"tokens": [1, 2]}, 200),
             ("/detokenize", {"tokens": [True]}, 422)]
    for path, body, status in cases:
        schema = {"$ref": f"#/components/schemas/{BODIES[path].__name__}",
                  "components": document["components"]}
        assert Draft202012Validator(schema).is_valid(body) == (status == 200), (path, body)
        assert httpx.post(f"{served}{path}", json=body, timeout=60).status_code == status, \
            (path, body)


def test_docs_are_served_from_this_machine(served):
    html = httpx.get(f"{served}/docs").text
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets and all(a.startswith("/docs/static/") for a in assets), assets   # no CDN
    assert "/openapi.json" in html
    for asset in assets:
        response = httpx.get(f"{served}{asset}")
        assert response.status_code == 200 and len(response.content) > 1000, asset


def fuzz(url: str, cwd) -> subprocess.CompletedProcess:
    """schemathesis over every operation of url's /openapi.json, deterministically: every check
    but positive_data_acceptance (the document gives types; the ranges and the context are
    checked by the server, as 400s the document lists)."""
    return subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
         "--checks", "all", "--exclude-checks", "positive_data_acceptance",
         "--max-examples", "25", "--generation-deterministic", "--workers", "1",
         "--request-timeout", "60", "--no-shrink", "--continue-on-failure"],
        capture_output=True, text=True, timeout=600, cwd=cwd)


def test_a_schema_driven_fuzzer_finds_no_server_error(served, tmp_path):
    run = fuzz(served, tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert re.search(r"Tested:\s+9\b", out), out[-3000:]
    generated = int(re.search(r"(\d+) generated", out).group(1))
    assert generated >= 200, out[-3000:]


def test_the_fuzzer_run_reports_a_server_error(tmp_path):
    """The same run against a small app that answers 500 for a negative number fails."""
    (tmp_path / "buggy.py").write_text(textwrap.dedent("""
        from fastapi import FastAPI
        from pydantic import BaseModel, ConfigDict

        class Body(BaseModel):
            model_config = ConfigDict(strict=True)
            n: int

        app = FastAPI()

        @app.post("/square_root")
        def square_root(body: Body) -> dict:
            if body.n < 0:
                raise RuntimeError("a negative number")
            return {"root": body.n ** 0.5}
        """))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "buggy:app", "--port", str(port)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            assert proc.poll() is None, "the small app did not start"
            try:
                httpx.get(f"{url}/openapi.json", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        run = fuzz(url, tmp_path)
    finally:
        proc.terminate()
        proc.wait(10)
    assert run.returncode != 0
    assert "[500] Internal Server Error" in run.stdout, run.stdout[-3000:]
