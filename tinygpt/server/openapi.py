"""/openapi.json and /docs: the API described as FastAPI and vLLM describe theirs, so client
generators and schema-driven fuzzers can find it. The generation and tokenizer endpoints read
their own bodies (under the body limits, parsed off the event loop), so FastAPI cannot see
their request models; each such route names its model with `request_body`, and
`openapi_schema` adds the request models of protocol.py to the components. /docs is Swagger UI
served from the files of the installed fastapi-offline package: nothing is fetched from the
internet, by the server or by the browser that opens it."""

from __future__ import annotations

from importlib.resources import files

from tinygpt.server.protocol import REQUESTS, ErrorResponse

ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "a malformed or out-of-range request, or one that does not fit the context"),
    (404, "an unknown model"),
    (408, "the body did not arrive within --body-timeout seconds"),
    (413, "the body is larger than --max-body-bytes"),
    (422, "a field of the wrong type"),
    (429, "the engine's queue is full (see Retry-After)"),
    (503, "the server is shutting down"))}


def request_body(model) -> dict:
    """A route's openapi_extra: its body is `model`, as JSON."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def stream_or(model) -> dict:
    """A 200 that is `model` as JSON, or server-sent events with stream: true."""
    return {"model": model, "description": "the whole response; with stream: true, "
            "server-sent events (data: {chunk} ... data: [DONE])",
            "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def openapi_schema(app) -> dict:
    """The app's OpenAPI document (built once): its routes, plus the request models."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             description=app.description, routes=app.routes)
        _, defs = models_json_schema([(model, "validation") for model in REQUESTS],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def add_docs(app, openapi_url: str = "/openapi.json", docs_url: str = "/docs") -> None:
    """Swagger UI at docs_url, its script and style served from this process."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    static = f"{docs_url}/static"
    app.mount(static, StaticFiles(directory=str(files("fastapi_offline") / "static")),
              name="docs-static")

    @app.get(docs_url, include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} API",
                                   swagger_js_url=f"{static}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{static}/swagger-ui.css",
                                   swagger_favicon_url=f"{static}/favicon.png")
