"""Running a server command: until Ctrl-C or SIGTERM, with one-line failures.

Every server command (``metaserver``, ``realtime``, ``scheduler``, ``cluster``)
opens its servers in an ``async with`` and waits here for a stop signal; a
server that cannot start (port in use, data folder locked or of another format)
ends the command with one error line and exit status 1, not a traceback.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from delaymq.metaserver.registry import RegistryError
from delaymq.protocol.errors import sole
from delaymq.storage.errors import StorageError

log = logging.getLogger("delaymq")

#: Errors that mean "this server cannot start here", reported in one line.
STARTUP_ERRORS: tuple[type[BaseException], ...] = (OSError, StorageError, RegistryError, ValueError)


async def wait_for_stop_signal() -> None:
    """Return on SIGTERM; Ctrl-C arrives as KeyboardInterrupt from trio.run."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("stopping on %s", signal.Signals(signum).name)
            return


def run_server(serve: Callable[..., Awaitable[Any]], *args: Any, what: str) -> int:
    """``trio.run(serve, *args)``; a start-up failure becomes one logged line and exit 1."""
    try:
        trio.run(serve, *args)
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


def fail(message: str, *, code: int = 2) -> int:
    log.error("%s", message)
    return code
