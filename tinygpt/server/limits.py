"""What one connection may cost the server before its request is even read: a body of at most
--max-body-bytes (413; by Content-Length before reading when the client sends one), arriving
within --body-timeout seconds (408), and request headers arriving within --header-timeout
seconds of the connection opening or of its last response (the connection is closed). uvicorn
itself closes idle keep-alive connections after KEEP_ALIVE_S and refuses header blocks over
64 KiB (cli.main sets both)."""

from __future__ import annotations

import asyncio

from tinygpt.server.protocol import APIError


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The body of a starlette Request, refused with 413 past max_bytes (by Content-Length
    before reading when the client sends one) and 408 when it does not arrive in timeout_s."""
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
    return b"".join(chunks)


def timed_h11(header_timeout: float):
    """uvicorn's h11 protocol, closing a connection whose request headers have not all
    arrived `header_timeout` seconds after it opened (or after its last response): uvicorn
    itself times out only idle keep-alive connections, so a client that sends its headers a
    byte at a time would hold its connection forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

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

    return TimedH11
