"""Running a server command: until Ctrl-C or SIGTERM, with one-line failures.

Every server command (``metaserver``, ``realtime``, ``scheduler``, ``cluster``)
opens its servers in an ``async with`` and waits here for a stop signal; a
server that cannot start (port in use, data folder locked or of another format)
ends the command with one error line and exit status 1, not a traceback.

SIGHUP reloads the tokens file of a server that has one, and is logged and
ignored by one that has none (``systemctl reload`` never stops a server). From the start
of ``run_server`` until trio runs it is ignored; from then on it is kept until the server
reads it, so one sent the moment the server says it listens is not lost.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import trio

from delaymq.client.registration import RegistrationRefused
from delaymq.metaserver.registry import RegistryError
from delaymq.net.auth import TokenFile
from delaymq.net.serving import tuned_collector
from delaymq.net.tls import TlsSettings
from delaymq.protocol.errors import sole
from delaymq.storage.errors import StorageError

if TYPE_CHECKING:
    from delaymq.cli.metrics import MetricsSource

log = logging.getLogger("delaymq")

#: Errors that mean "this server cannot start here", reported in one line.
#: (``RegistrationRefused``: the metaserver said no, e.g. a plaintext server to a TLS one.)
STARTUP_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    StorageError,
    RegistryError,
    RegistrationRefused,
    ValueError,
)


#: SIGHUPs received since ``run_server`` started trio: kept until ``wait_for_stop_signal`` reads them,
#: so a reload sent the moment a server says it listens is not lost.
_hangups: ContextVar[AsyncIterator[int] | None] = ContextVar("hangups", default=None)


async def wait_for_stop_signal(*, tokens: TokenFile | None = None) -> None:
    """Return on SIGTERM; Ctrl-C arrives as KeyboardInterrupt from trio.run.

    SIGHUP reloads ``tokens`` (a bad file is logged and the old table kept); without
    ``tokens`` it is logged and ignored."""
    hangups = _hangups.get()
    if hangups is None:
        with trio.open_signal_receiver(signal.SIGHUP) as received:
            await _serve_signals(received, tokens)
    else:
        await _serve_signals(hangups, tokens)


async def _serve_signals(hangups: AsyncIterator[int], tokens: TokenFile | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_reload_on_hangup, hangups, tokens)
        with trio.open_signal_receiver(signal.SIGTERM) as stops:
            async for signum in stops:
                log.info("stopping on %s", signal.Signals(signum).name)
                break
        nursery.cancel_scope.cancel()


async def _reload_on_hangup(hangups: AsyncIterator[int], tokens: TokenFile | None) -> None:
    async for _ in hangups:
        if tokens is not None:
            tokens.reload()
        else:
            log.warning("SIGHUP: no --tokens-file to reload; ignored")


async def serve_until_stopped(
    *,
    metrics_listen: str | None,
    metrics: Callable[[], MetricsSource],
    tokens: TokenFile | None = None,
    tls: TlsSettings | None = None,
) -> None:
    """Wait for a stop signal; meanwhile serve Prometheus metrics (``metrics()``) on ``metrics_listen`` if given
    (over HTTPS with the server's ``tls`` certificate; with ``tokens``, to a bearer token of role admin or
    server only), and reload ``tokens`` on SIGHUP.

    The metrics modules (prometheus_client, and every server's statistics types) are
    imported only then: a server started without metrics starts that much sooner."""
    if metrics_listen is None:
        await wait_for_stop_signal(tokens=tokens)
        return
    from delaymq.cli.metrics import Exposition
    from delaymq.cli.metrics_endpoint import open_metrics_endpoint

    async with open_metrics_endpoint(Exposition(metrics()), metrics_listen, tls=tls, tokens=tokens):
        await wait_for_stop_signal(tokens=tokens)


@contextmanager
def sighup_ignored() -> Iterator[None]:
    """SIGHUP ignored for the block (in the main thread; elsewhere signals cannot be set): a reload
    sent while a server starts, before ``wait_for_stop_signal`` listens for it, must not stop it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def run_server(serve: Callable[..., Awaitable[Any]], *args: Any, what: str) -> int:
    """``trio.run(serve, *args)`` with the collector tuned for serving (``tuned_collector``) and SIGHUP
    ignored until ``wait_for_stop_signal`` handles it; a start-up failure becomes one logged line and exit 1."""
    try:
        with tuned_collector(), sighup_ignored():
            trio.run(_serve_keeping_hangups, serve, *args)
    except BaseException as raised:  # noqa: B036 - sorted below: start-up errors are one line, the rest re-raised
        if not isinstance(raised, (*STARTUP_ERRORS, BaseExceptionGroup)):
            raise
        error = sole(raised)
        if isinstance(error, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # Ctrl-C while starting or stopping
        if not isinstance(error, STARTUP_ERRORS):
            raise
        return fail(f"cannot run {what}: {error}", code=1)
    return 0


async def _serve_keeping_hangups(serve: Callable[..., Awaitable[Any]], *args: Any) -> None:
    if threading.current_thread() is not threading.main_thread():  # signals belong to the main thread
        await serve(*args)
        return
    with trio.open_signal_receiver(signal.SIGHUP) as hangups:
        _hangups.set(hangups)
        await serve(*args)


def fail(message: str, *, code: int = 2) -> int:
    log.error("%s", message)
    return code
