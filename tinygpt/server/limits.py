"""What a request must be, and what it may cost the server, before its body is parsed.

A body (read_body) is JSON as sent: a Content-Type other than application/json or
application/*+json (any parameters, any case; none at all is taken as JSON) is a 415 naming
Content-Type, and so is a Content-Encoding other than identity (the server does not decode
bodies; a 415 naming Content-Encoding). It has at most --max-body-bytes (413; by Content-Length
before reading when the client sends one) and arrives within --body-timeout seconds (408). A
client that closes its connection before its body is in gets no answer, since none could reach
it: one line in the log, and status 499 ("client closed request", nginx's number) in /metrics.

A connection (guarded_h11: uvicorn's h11 protocol with three changes) sends its request
headers within --header-timeout seconds of opening or of its last response (else it is closed),
as a request line and headers of at most MAX_HEADER_BYTES however the bytes arrive (else a 431;
h11 alone lets a block that arrives whole through at any size). HTTP that h11 cannot parse is
answered with the server's JSON error body, not uvicorn's plain text: a malformed chunked body
with a 400 from the endpoint reading it (read_body), anything else with a 400 from the protocol
itself, which then (as after a 431) reads and drops what the client still sends for up to
LINGER_S seconds before it closes: a socket closed with bytes unread sends a reset, which can
destroy the answer before the client reads it. Those answers never reach the app, so its
middleware cannot count them: the protocol reports each one (on_refused, which cli.serve points
at /metrics, where they count under the path "other"). uvicorn itself closes idle keep-alive
connections after KEEP_ALIVE_S (cli.main sets it)."""

from __future__ import annotations

import asyncio
import http
import json
import logging
import re
from collections.abc import Callable

import h11
from starlette.requests import ClientDisconnect

from tinygpt.server.protocol import APIError

MAX_HEADER_BYTES = 64 * 1024      # request line and headers, the blank line after them included
LINGER_S = 5.0                    # a refused connection's bytes are read and dropped this long
BODY_ERROR = "tinygpt.body_error"   # the scope key where the protocol says why a body broke
JSON_MEDIA = re.compile(r"application/(?:[^/\s]+\+)?json")
HEAD_END = re.compile(b"\n\r?\n")  # the blank line that ends a header block, as h11 finds it
log = logging.getLogger("uvicorn.error")

# -- the body -------------------------------------------------------------------------------------


def check_media(headers) -> None:
    """APIError 415 unless the body is JSON as sent: Content-Type absent, application/json or
    application/*+json (parameters such as charset=utf-8 allowed, any case), and Content-Encoding
    absent or identity."""
    for value in headers.getlist("content-type"):
        if not JSON_MEDIA.fullmatch(value.split(";", 1)[0].strip().lower()):
            raise APIError(415, f"Content-Type is {value!r}; this endpoint reads a JSON body: "
                                f"send Content-Type: application/json (with curl: -H "
                                f"'Content-Type: application/json'; -d alone sends "
                                f"application/x-www-form-urlencoded)", param="Content-Type",
                           code="unsupported_media_type")
    for value in headers.getlist("content-encoding"):
        if any(coding.strip().lower() not in ("", "identity") for coding in value.split(",")):
            raise APIError(415, f"Content-Encoding is {value!r}; this server does not decode "
                                f"bodies: send the JSON as it is, with no Content-Encoding (or "
                                f"identity)", param="Content-Encoding",
                           code="unsupported_media_type", headers={"Accept-Encoding": "identity"})


def check_framing(request) -> None:
    """APIError 400 when the protocol found the body's chunked framing malformed (guarded_h11);
    the connection closes after the answer, since where the next request begins is unknown."""
    broken = request.scope.get(BODY_ERROR)
    if broken is not None:
        raise APIError(400, f"the request body's chunked framing is malformed ({broken}); send "
                            f"well-formed chunks or a body with a Content-Length",
                       param="Transfer-Encoding", code="malformed_body",
                       headers={"Connection": "close"})


def client_left(request, received: int) -> APIError:
    """The 499 for a client that closed its connection before its body was in: logged in one
    line, answered to no one (uvicorn drops what is sent on a closed connection)."""
    who = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    log.info('%s - "%s %s": the client closed its connection after %d bytes of its body; not '
             'answered', who, request.method, request.url.path, received)
    return APIError(499, "the client closed its connection before its body arrived",
                    code="client_closed_request")


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The body of a starlette Request, refused with 400 when its chunked framing is malformed,
    415 unless it is JSON as sent (check_media), 413 past max_bytes (by Content-Length before
    reading when the client sends one) and 408 when it does not arrive in timeout_s; 499 (to no
    one) when the client leaves first."""
    check_framing(request)
    check_media(request.headers)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        raise APIError(413, f"the body has {length} bytes; this server takes at most "
                            f"{max_bytes} (--max-body-bytes)", code="body_too_large")
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"the body is longer than {max_bytes} bytes "
                                    f"(--max-body-bytes)", code="body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except TimeoutError:
        raise APIError(408, f"the body did not arrive within {timeout_s} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise client_left(request, size) from None
    check_framing(request)
    return b"".join(chunks)

# -- the connection -------------------------------------------------------------------------------


class LimitedConnection(h11.Connection):
    """h11's server side with an exact header limit, keeping its last protocol error and the
    state the client was in when it came (uvicorn catches the error and keeps only a log line).

    h11 alone refuses a header block only while it is incomplete and its buffer is past the
    limit: a block that arrives whole in one read is parsed at any size. Here, while the client
    is between requests (IDLE), h11's unparsed bytes (its _receive_buffer) begin with the next
    request, so a buffer past the limit whose first max_header_bytes hold no blank line holds a
    header block longer than the limit."""

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes
        self.error: h11.RemoteProtocolError | None = None
        self.error_in: type | None = None

    def next_event(self):
        state = self.their_state
        try:
            if state is h11.IDLE:
                self.check_header_size()
            return super().next_event()
        except h11.RemoteProtocolError as err:
            self.error, self.error_in = err, state
            raise

    def check_header_size(self) -> None:
        buffered = self._receive_buffer
        if len(buffered) > self.max_header_bytes and not HEAD_END.search(
                bytes(buffered), 0, self.max_header_bytes):
            raise h11.RemoteProtocolError(
                f"the request line and headers are longer than {self.max_header_bytes} bytes, "
                f"the most this server reads; send smaller headers", error_status_hint=431)


def error_events(status: int, message: str, default_headers: list) -> list:
    """The h11 events of a JSON error response that closes its connection."""
    code = http.HTTPStatus(status).phrase.lower().replace(" ", "_")
    body = json.dumps(APIError(status, message, code=code).body(),
                      separators=(",", ":")).encode()
    headers = [*default_headers, (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    return [h11.Response(status_code=status, headers=headers,
                         reason=http.HTTPStatus(status).phrase.encode()),
            h11.Data(data=body), h11.EndOfMessage()]


def guarded_h11(header_timeout: float, max_header_bytes: int = MAX_HEADER_BYTES,
                on_refused: Callable[[int], None] = lambda status: None):
    """uvicorn's h11 protocol, with the header timer, the exact header limit (LimitedConnection)
    and JSON answers to HTTP that h11 cannot parse, each reported by status to on_refused.
    uvicorn itself times out only idle keep-alive connections, so a client that sends its
    headers a byte at a time would hold its connection forever; and it answers a protocol error
    with a text/plain 400 and closes at once."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.conn = LimitedConnection(max_header_bytes)
            self._refused = False        # a protocol error was answered: drop what follows

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()
            # uvicorn starts a pipelined request (one whose headers already came) in there:
            # its headers are in, so no timer; a timer armed with its cycle would close the
            # connection in the middle of its answer
            if self.cycle is finished:
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._headers_due = self.loop.call_later(header_timeout, self._headers_late,
                                                     self.cycle)

        def _headers_late(self, cycle_then) -> None:
            # a request whose headers arrived since the timer was armed has a new cycle
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            # uvicorn calls this for each h11.RemoteProtocolError, after logging one line
            if self._refused:
                return
            self._refused = True
            cycle, error = self.cycle, self.conn.error
            if cycle is not None and not cycle.response_complete:
                if self.conn.error_in is h11.SEND_BODY and not cycle.response_started:
                    # the endpoint reading this body answers (read_body's check_framing)
                    cycle.scope[BODY_ERROR] = str(error)
                    cycle.more_body = False
                    cycle.message_event.set()
                else:                    # its answer is under way: finish it, then close
                    cycle.keep_alive = False
                return
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                status = error.error_status_hint if error is not None else 400
                message = str(error) if status == 431 else \
                    f"the request is not valid HTTP/1.1 ({error})"
                for event in error_events(status, message, self.server_state.default_headers):
                    self.transport.write(self.conn.send(event))
                on_refused(status)
            self._linger()

        def _linger(self) -> None:
            if self.transport.can_write_eof():
                self.transport.write_eof()       # the answer, then the end of what we send
            self.loop.call_later(LINGER_S, self.transport.close)

    return GuardedH11
