"""Fixtures for every test folder: servers run in child processes (SIGKILL them as a crash would)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

#: ``python -c REALTIME_SERVER DATA_DIR OPTIONS``: a realtime server on the wall clock, its log on stderr.
REALTIME_SERVER = """
import json, logging, sys, trio
from delaymq.realtime import open_realtime_server
from delaymq.wheel.clock import SystemClock

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")

async def main():
    options = json.loads(sys.argv[2])
    async with open_realtime_server(data_dir=sys.argv[1], clock=SystemClock(), **options) as server:
        print(server.address, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""

ServerProcess = AbstractAsyncContextManager[tuple[str, trio.Process]]


@asynccontextmanager
async def python_server(
    script: str, *args: str, log_file: Path | None = None, cwd: Path | None = None
) -> AsyncIterator[tuple[str, trio.Process]]:
    """``python -P -c script *args``, a server that prints its address first; yields the address and the process.

    Its stderr is appended to ``log_file`` (inherited without one). Still running at the end, it is SIGKILLed.
    """
    with open(log_file, "ab") if log_file else nullcontext() as log:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-P", "-c", script, *args], stdout=subprocess.PIPE, stderr=log, cwd=cwd
        )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1024)
                assert chunk, f"the server exited with {await process.wait()} before printing its address"
                line += chunk
        yield line.decode().strip(), process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        await process.wait()


def realtime_server(data_dir: Path, *, log_file: Path | None = None, **options: Any) -> ServerProcess:
    """A realtime server on ``data_dir`` in a child process; ``options`` (JSON) go to ``open_realtime_server``."""
    return python_server(REALTIME_SERVER, str(data_dir), json.dumps(options), log_file=log_file, cwd=data_dir.parent)


@pytest.fixture
def server_processes() -> SimpleNamespace:
    """Servers in child processes: ``realtime(data_dir, **options)``, ``python(script, *args)``."""
    return SimpleNamespace(realtime=realtime_server, python=python_server)


class ScheduleFolder:
    """A scheduler's message log, lmdb state and schedule store in ``root``, reopened at will:
    ``add`` appends records and files them, as the master's replay does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.schedule = root / "schedule"
        self.open()

    def open(self) -> None:
        from delaymq.scheduler.schedulelog import ScheduleStore
        from delaymq.storage.log import SegmentedLog
        from delaymq.storage.state import StateStore

        self.log = SegmentedLog.open(self.root / "messages")
        self.state = StateStore.open(self.root / "state")
        self.store = ScheduleStore.open(self.schedule, self.state)

    def add(self, *records: bytes) -> None:
        from delaymq.scheduler.replay import replay_until_caught_up

        self.log.append(b"".join(records))
        self.log.flush()
        replay_until_caught_up(self.log, self.store)

    def reopen(self) -> None:
        self.close()
        self.open()

    def close(self) -> None:
        self.store.close()
        self.state.close()
        self.log.close()


@pytest.fixture
def schedule_folder(tmp_path: Path) -> Iterator[ScheduleFolder]:
    opened = ScheduleFolder(tmp_path)
    yield opened
    opened.close()
