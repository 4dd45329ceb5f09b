"""Fixtures for every test folder: servers run in child processes (SIGKILL them as a crash would)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trustme

from delaymq.net.limits import Limits
from delaymq.net.tls import TlsSettings

#: ``python -c REALTIME_SERVER DATA_DIR OPTIONS``: a realtime server on the wall clock, its log on stderr.
REALTIME_SERVER = """
import json, logging, sys, trio
from delaymq.realtime import open_realtime_server
from delaymq.clock import SystemClock

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
def store_folder(tmp_path: Path) -> Iterator[ScheduleFolder]:
    opened = ScheduleFolder(tmp_path)
    yield opened
    opened.close()


@dataclass(frozen=True)
class Pki:
    """The files of one CA, a server certificate for 127.0.0.1, a client certificate, and a stranger CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path

    def server(self, *, require_client_cert: bool = False) -> TlsSettings:
        return TlsSettings(
            cert=self.server_cert, key=self.server_key, ca=self.ca, require_client_cert=require_client_cert
        )

    def client(self, *, with_cert: bool = True) -> TlsSettings:
        if not with_cert:
            return TlsSettings(ca=self.ca)
        return TlsSettings(cert=self.client_cert, key=self.client_key, ca=self.ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Certificates made on the fly with ``trustme``, once per module."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@delaymq.test")
    files = {
        "ca": ca.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
        "other_ca": other.cert_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(folder / f"{name}.pem"))
    return Pki(**{name: folder / f"{name}.pem" for name in files})


@dataclass
class LocalServers:
    meta: Any  # Metaserver
    realtime: Any  # RealtimeServer
    scheduler: Any  # Scheduler

    @property
    def address(self) -> str:
        assert self.meta.address is not None
        return str(self.meta.address)


@asynccontextmanager
async def open_local_servers(
    root: Path, limits: Limits, *, wait: float = 20.0, **realtime_options: Any
) -> AsyncIterator[LocalServers]:
    """A metaserver, a realtime server (with ``realtime_options``) and a scheduler in-process on loopback
    with the real clock, every listener and connection with ``limits`` (TLS, tokens); yielded once both
    servers have registered with the metaserver."""
    from delaymq.clock import SystemClock
    from delaymq.metaserver.server import open_metaserver
    from delaymq.realtime.server import open_realtime_server
    from delaymq.scheduler.server import open_scheduler

    clock = SystemClock()
    async with AsyncExitStack() as stack:
        meta = await stack.enter_async_context(open_metaserver(data_dir=root / "meta", clock=clock, limits=limits))
        assert meta.address is not None
        realtime = await stack.enter_async_context(
            open_realtime_server(
                data_dir=root / "rt", clock=clock, meta_address=meta.address, limits=limits, **realtime_options
            )
        )
        scheduler = await stack.enter_async_context(
            open_scheduler(data_dir=root / "sched", clock=clock, meta_address=meta.address, limits=limits)
        )
        with trio.fail_after(wait):
            for server in (realtime, scheduler):
                assert server.registration is not None
                await server.registration.wait_registered()
        yield LocalServers(meta, realtime, scheduler)
