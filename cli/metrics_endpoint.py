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

Given the server's tokens file (``--tokens-file``), every request must carry
``Authorization: Bearer TOKEN`` of a token in that file with role ``admin`` or
``server``, checked against the file as it is then (a SIGHUP reload applies at the
next scrape) before anything else is done: a request without a known token is
answered 401 (with ``WWW-Authenticate: Bearer``), one whose token has neither role
403, and neither says more. Without a tokens file the endpoint asks for no token
(the server command serves it on loopback only, unless ``--insecure-listen``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from prometheus_client import CONTENT_TYPE_LATEST

from delaymq.cli.metrics import Exposition
from delaymq.net.addresses import format_address, split_listen
from delaymq.net.admission import RefusalLog
from delaymq.net.auth import TokenFile
from delaymq.net.tls import TlsSettings

log = logging.getLogger("delaymq.metrics")

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 10.0
MAX_SCRAPES = 16
METRICS_PATHS = ("/metrics", "/")
#: The roles a token needs to read the metrics (any one of them).
METRICS_ROLES = frozenset({"admin", "server", "metrics"})
#: What a request without a known token is told to present.
CHALLENGE = 'Bearer realm="delaymq metrics"'


class BadRequest(Exception):
    """The bytes received are not an HTTP request head we answer."""


@dataclass(frozen=True, slots=True)
class RequestLine:
    method: str
    path: str
    #: The value of the ``Authorization`` header (the first one), if any; a secret, so never in a repr.
    authorization: str | None = field(default=None, repr=False)


def parse_request_head(head: bytes) -> RequestLine:
    """The method, path (query string dropped) and ``Authorization`` header of a complete request head."""
    line, *header_lines = head.split(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise BadRequest(f"not an HTTP/1.x request line: {line[:80]!r}")
    method, target = parts[0].decode("ascii", "replace"), parts[1].decode("ascii", "replace")
    authorization = None
    for header_line in header_lines:
        name, colon, value = header_line.partition(b":")
        if colon and name.strip().lower() == b"authorization":
            authorization = value.strip().decode("latin-1")
            break
    return RequestLine(method, target.split("?", 1)[0], authorization)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` value (the scheme in any case); None for anything else."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def response(
    status: str,
    body: bytes,
    *,
    content_type: str = "text/plain; charset=utf-8",
    head_only: bool = False,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """A complete HTTP/1.1 response that closes the connection."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    header = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
        "Connection: close\r\n\r\n"
    )
    return header.encode("ascii") + (b"" if head_only else body)


def refusal(request: RequestLine, tokens: TokenFile | None) -> tuple[str, bytes] | None:
    """Why ``request`` may not read the metrics: the kind (for the log) and the response; None: it may.

    Without ``tokens`` anyone may; with them, a bearer token of the file (as it is now) with role
    admin, server or metrics. The answer names neither the tokens nor their roles."""
    if tokens is None:
        return None
    identity = tokens.table.identify(bearer_token(request.authorization))
    if identity is None:
        body = b"unauthorized: send Authorization: Bearer TOKEN\n"
        return "unauthorized", response("401 Unauthorized", body, headers={"WWW-Authenticate": CHALLENGE})
    if not identity.roles & METRICS_ROLES:
        return "forbidden", response("403 Forbidden", b"forbidden\n")
    return None


async def answer(request: RequestLine, exposition: Exposition) -> bytes:
    """The response to one request that may read the metrics."""
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

    def __init__(
        self, exposition: Exposition, *, tls: TlsSettings | None = None, tokens: TokenFile | None = None
    ) -> None:
        self.exposition = exposition
        self.tokens = tokens
        self._context = tls.server_context() if tls is not None else None
        self.scheme = "http" if self._context is None else "https"
        self.address = ""
        self.scrapes = 0
        #: Requests refused for their token (401 and 403).
        self.refused = 0
        self._refusals = RefusalLog()
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
                        await stream.send_all(await self._reply(head, tcp))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return  # the scraper went away (or failed the TLS handshake)

    async def _reply(self, head: bytes, tcp: trio.SocketStream) -> bytes:
        """The response to a request head: 400, a refusal of its token, or ``answer``."""
        try:
            request = parse_request_head(head)
        except BadRequest:
            return response("400 Bad Request", b"bad request\n")
        refused = refusal(request, self.tokens)
        if refused is not None:
            kind, reply = refused
            self.refused += 1
            self._log_refusal(kind, tcp)
            return reply
        self.scrapes += 1
        return await answer(request, self.exposition)

    def _log_refusal(self, kind: str, tcp: trio.SocketStream) -> None:
        count = self._refusals.note(kind, trio.current_time())
        if count is None:
            return
        try:
            peer = format_address(*tcp.socket.getpeername()[:2])
        except OSError:
            peer = "a client gone since"
        more = f" ({count} since the last line)" if count > 1 else ""
        log.warning("metrics: refused a scrape from %s: %s%s", peer, kind, more)


@asynccontextmanager
async def open_metrics_endpoint(
    exposition: Exposition, listen: str, *, tls: TlsSettings | None = None, tokens: TokenFile | None = None
) -> AsyncIterator[MetricsEndpoint]:
    """Serve ``exposition`` on ``listen`` for the duration of the block (HTTPS when ``tls`` has a certificate;
    with ``tokens``, to a bearer token of role admin or server only)."""
    endpoint = MetricsEndpoint(exposition, tls=tls, tokens=tokens)
    async with trio.open_nursery() as nursery:
        await nursery.start(endpoint.serve, listen)
        access = "bearer token of role admin or server" if tokens is not None else "no token asked"
        log.info("metrics on %s://%s/metrics (%s)", endpoint.scheme, endpoint.address, access)
        yield endpoint
        nursery.cancel_scope.cancel()


__all__ = [
    "METRICS_ROLES",
    "MetricsEndpoint",
    "bearer_token",
    "open_metrics_endpoint",
    "parse_request_head",
    "refusal",
    "response",
]
