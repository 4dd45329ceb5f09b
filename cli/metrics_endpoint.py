"""The HTTP endpoint Prometheus scrapes (``--metrics-listen HOST:PORT``), served by trio.

It runs on the server's own event loop, so a scrape reads the server's statistics on
the thread that changes them. ``GET /metrics`` (or ``/``) answers the text exposition
format; another path is 404, another method 405. Each connection carries one request
(``Connection: close``): a scrape every few seconds needs no keep-alive. A request
head larger than ``MAX_HEAD_BYTES`` or slower than ``HEAD_TIMEOUT_S`` is dropped, and
past ``MAX_SCRAPES`` connections at once the newest is closed unanswered, so a
misbehaving scraper costs a few descriptors, never the server. A scrape that fails is
answered 500 and logged; it never stops the server. Given the server's ``TlsSettings``
(``--tls-cert``...), the endpoint speaks HTTPS with the same certificate (and asks for a
client certificate as the server's own listener does).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from prometheus_client import CONTENT_TYPE_LATEST

from delaymq.cli.metrics import Exposition
from delaymq.protocol.tls import TlsSettings
from delaymq.protocol.transport import format_address, split_listen

log = logging.getLogger("delaymq.metrics")

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 10.0
MAX_SCRAPES = 16
METRICS_PATHS = ("/metrics", "/")


class BadRequest(Exception):
    """The bytes received are not an HTTP request head we answer."""


@dataclass(frozen=True, slots=True)
class RequestLine:
    method: str
    path: str


def parse_request_head(head: bytes) -> RequestLine:
    """The method and path (query string dropped) of a complete request head."""
    line = head.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise BadRequest(f"not an HTTP/1.x request line: {line[:80]!r}")
    method, target = parts[0].decode("ascii", "replace"), parts[1].decode("ascii", "replace")
    return RequestLine(method, target.split("?", 1)[0])


def response(
    status: str, body: bytes, *, content_type: str = "text/plain; charset=utf-8", head_only: bool = False
) -> bytes:
    """A complete HTTP/1.1 response that closes the connection."""
    header = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return header.encode("ascii") + (b"" if head_only else body)


async def answer(request: RequestLine, exposition: Exposition) -> bytes:
    """The response to one request."""
    if request.path not in METRICS_PATHS:
        return response("404 Not Found", b"not found: the metrics are at /metrics\n")
    if request.method not in ("GET", "HEAD"):
        return response("405 Method Not Allowed", b"only GET and HEAD\n")
    try:
        body = await exposition.render()
    except Exception:  # a mapping bug must not stop the server: say so, once per scrape
        log.exception("metrics: the scrape failed")
        return response("500 Internal Server Error", b"the scrape failed; see the server's log\n")
    return response("200 OK", body, content_type=CONTENT_TYPE_LATEST, head_only=request.method == "HEAD")


async def _read_head(stream: trio.abc.Stream) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        data += chunk
    return data


class MetricsEndpoint:
    """Serves one server's ``Exposition`` over HTTP."""

    def __init__(self, exposition: Exposition, *, tls: TlsSettings | None = None) -> None:
        self.exposition = exposition
        self._context = tls.server_context() if tls is not None else None
        self.scheme = "http" if self._context is None else "https"
        self.address = ""
        self.scrapes = 0
        self._slots = trio.Semaphore(MAX_SCRAPES)

    async def serve(self, listen: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``listen`` (port 0: any free one) until cancelled; ``nursery.start`` gets the bound address."""
        host, port = split_listen(listen)
        listeners = await trio.open_tcp_listeners(port, host=host)
        sockname = listeners[0].socket.getsockname()
        self.address = format_address(sockname[0], sockname[1])
        task_status.started(self.address)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp
        if self._context is not None:
            stream = trio.SSLStream(tcp, self._context, server_side=True)
        async with tcp:
            if self._slots.value == 0:
                return  # too many scrapes at once: close this one unanswered
            async with self._slots:
                try:
                    with trio.move_on_after(HEAD_TIMEOUT_S):
                        if isinstance(stream, trio.SSLStream):
                            await stream.do_handshake()
                        head = await _read_head(stream)
                        if head is None:
                            return
                        try:
                            request = parse_request_head(head)
                        except BadRequest:
                            await stream.send_all(response("400 Bad Request", b"bad request\n"))
                            return
                        reply = await answer(request, self.exposition)
                        self.scrapes += 1
                        await stream.send_all(reply)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return  # the scraper went away (or failed the TLS handshake)


@asynccontextmanager
async def open_metrics_endpoint(
    exposition: Exposition, listen: str, *, tls: TlsSettings | None = None
) -> AsyncIterator[MetricsEndpoint]:
    """Serve ``exposition`` on ``listen`` for the duration of the block (HTTPS when ``tls`` has a certificate)."""
    endpoint = MetricsEndpoint(exposition, tls=tls)
    async with trio.open_nursery() as nursery:
        await nursery.start(endpoint.serve, listen)
        log.info("metrics on %s://%s/metrics", endpoint.scheme, endpoint.address)
        yield endpoint
        nursery.cancel_scope.cancel()


__all__ = ["MetricsEndpoint", "open_metrics_endpoint", "parse_request_head", "response"]
