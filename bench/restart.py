"""``delaymq bench restart``: how long a scheduler holding a big backlog takes to serve again.

The goal is a restart to serving in at most 2 s with 10 million messages scheduled
(docs/performance.md, "Goals"). The benchmark builds a scheduler data folder holding ``count``
messages of 100 bytes spread over the next 30 days (written and filed with the
scheduler's own storage code, as a scheduler would have left it, which is much
faster than sending them), then runs a metaserver, a realtime server and that
scheduler as separate ``delaymq`` processes, as in production. A consumer takes a
stream of messages due every few milliseconds while the scheduler is SIGKILLed and
started again, and then stopped with SIGTERM and started again. For each restart it
prints the time from the signal to STATUS answering, to answering as master, and to
the first due message received; and the lateness of the messages due meanwhile
(goal: none later than the restart itself). Figures are printed, never asserted.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from delaymq.bench.cluster import percentiles
from delaymq.client import open_consumer, open_producer
from delaymq.net.connection import TransportError
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError

Row = tuple[str, float, str]
BODY = b"x" * 100
SPREAD_MS = 30 * 86_400_000
#: Messages due during each restart: one every STREAM_EVERY_MS for STREAM_MS.
STREAM_EVERY_MS = 5
STREAM_MS = 20_000
_BUILD_BATCH = 10_000


def build_backlog(
    data: Path,
    count: int,
    *,
    now_ms: int,
    spread_ms: int = SPREAD_MS,
    first_due_ms: int = 60_000,
    message_id: Callable[[int], str] | None = None,
    key: Callable[[int], str] | None = None,
    seed: int = 13,
) -> float:
    """A scheduler data folder holding ``count`` messages due over ``spread_ms`` from
    ``first_due_ms`` after ``now_ms``, every one filed (and indexed); message ``n`` has id
    ``message_id(n)`` (default: a new one) and, given ``key``, the business key ``key(n)``.
    Returns the seconds it took."""
    from delaymq.protocol.records import encode_message, new_message_id
    from delaymq.scheduler.replay import replay_until_caught_up
    from delaymq.scheduler.schedulelog import ScheduleStore
    from delaymq.storage.log import SegmentedLog
    from delaymq.storage.state import StateStore

    started = time.perf_counter()
    rng = random.Random(seed)
    data.mkdir(parents=True, exist_ok=True)
    with SegmentedLog.open(data / "messages") as log:
        for first in range(0, count, _BUILD_BATCH):
            log.append(
                b"".join(
                    encode_message(
                        message_id(n) if message_id is not None else new_message_id(now_ms),
                        "backlog",
                        properties={"key": key(n)} if key is not None else None,
                        body=BODY,
                        deliver_at=now_ms + first_due_ms + int(rng.random() * spread_ms),
                        created_at=now_ms,
                    )
                    for n in range(first, min(count, first + _BUILD_BATCH))
                )
            )
        log.flush()
        state = StateStore.open(data / "state", extra_format={"scheduler_state": 1})
        try:
            with ScheduleStore.open(data / "schedule", state) as store:
                replay_until_caught_up(log, store, max_bytes=64 << 20)
        finally:
            state.close()
    return time.perf_counter() - started


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class Servers:
    """The three server processes; the scheduler's is replaced on each restart."""

    scratch: Path
    meta: str = field(default_factory=free_address)
    realtime: str = field(default_factory=free_address)
    scheduler: str = field(default_factory=free_address)
    scheduler_process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "info", *args]

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        self.starts += 1
        log = open(self.scratch / f"{name}-{self.starts}.log", "wb")  # the child holds it from here
        try:
            return subprocess.Popen(self.command(*args), stdout=subprocess.DEVNULL, stderr=log)
        finally:
            log.close()

    def start_scheduler(self, data: Path) -> None:
        self.scheduler_process = self.spawn(
            "scheduler",
            "scheduler",
            "--listen",
            self.scheduler,
            "--meta",
            self.meta,
            "--data",
            str(data),
            "--min-insync",
            "0",
        )


@contextmanager
def running_servers(scratch: Path, scheduler_data: Path) -> Iterator[Servers]:
    servers = Servers(scratch)
    with ExitStack() as stack:
        processes = [
            servers.spawn("metaserver", "metaserver", "--listen", servers.meta, "--data", str(scratch / "meta")),
            servers.spawn(
                "realtime",
                "realtime",
                "--listen",
                servers.realtime,
                "--meta",
                servers.meta,
                "--data",
                str(scratch / "realtime"),
                "--min-insync",
                "0",
            ),
        ]
        stack.callback(_stop, processes)
        servers.start_scheduler(scheduler_data)
        stack.callback(lambda: _stop([servers.scheduler_process] if servers.scheduler_process else []))
        yield servers


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Serving:
    """Seconds from a moment (the signal) to each sign of service."""

    status: float = -1.0  # STATUS answered
    master: float = -1.0  # STATUS says master: SCHEDULE is taken and due messages go out


async def wait_serving(address: str, process: subprocess.Popen[bytes], since: float, timeout: float = 600) -> Serving:
    """Ask STATUS every few milliseconds until the scheduler answers as master.

    Each try is a fresh connection (a client's reconnect backoff would add its own delay)."""
    serving = Serving()
    with trio.fail_after(timeout):
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the scheduler exited with status {process.returncode}; see its log")
            try:
                async with open_peers(request_timeout=5) as peers:
                    answer = await peers.call(address, Command.STATUS, {"hours": 1})
                    if serving.status < 0:
                        serving.status = time.perf_counter() - since
                    if answer.metadata["statistics"]["role"] == "master":
                        serving.master = time.perf_counter() - since
                        return serving
            except (OSError, PeerError, TransportError, trio.BrokenResourceError):
                pass
            await trio.sleep(0.005)  # polling another process for readiness, not synchronising a test


async def wait_delivering(meta: str, timeout: float = 120) -> None:
    """Send one message for now and take it: the realtime server is registered and routed to."""
    with trio.fail_after(timeout):
        async with open_consumer(meta, "warm-up", group="bench", start="earliest") as consumer:
            async with open_producer(meta) as producer:
                await producer.send("warm-up", b"hello")
            async for message in consumer:
                await message.ack()
                return


@dataclass
class RestartFigures:
    signal: str
    exited: float  # seconds from the signal to the old process's exit
    serving: Serving
    first_due_received: float  # seconds from the signal to the first message due after it arriving
    down_lateness: list[float]  # ms, messages due between the signal and serving again
    lateness: list[float]  # ms, every message of the stream
    lost: int
    early: int


async def restart_under_stream(servers: Servers, data: Path, how: signal.Signals) -> RestartFigures:
    """Stream messages due every few ms, stop the scheduler with ``how`` midway, start it again."""
    subject = f"due-{how.name.lower()}"
    received: dict[str, tuple[int, int]] = {}  # id -> (deliver_at, received_at), epoch ms
    sent: dict[str, int] = {}
    count = STREAM_MS // STREAM_EVERY_MS
    all_in = trio.Event()
    async with open_consumer(servers.meta, subject, group="bench", start="earliest", pull_batch=1000) as consumer:
        async with open_producer(servers.meta) as producer:

            async def consume() -> None:
                async for message in consumer:
                    received.setdefault(message.id, (message.deliver_at, message.received_at))
                    await message.ack()
                    if len(received) >= count:
                        all_in.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                first_due = time.time() * 1000 + 2_000  # a benchmark's wall clock, not server code
                messages = [
                    producer.message(subject, BODY, at=int(first_due) + i * STREAM_EVERY_MS) for i in range(count)
                ]
                for start in range(0, count, 1000):
                    for message_id, message in zip(
                        await producer.send_batch(messages[start : start + 1000]), messages[start : start + 1000]
                    ):
                        sent[message_id] = message.deliver_at
                await trio.sleep(max(0.0, (first_due + STREAM_MS / 3) / 1000 - time.time()))
                process = servers.scheduler_process
                assert process is not None
                killed_at = time.perf_counter()
                killed_ms = time.time() * 1000
                process.send_signal(how)
                await trio.to_thread.run_sync(process.wait)
                exited = time.perf_counter() - killed_at
                servers.start_scheduler(data)
                assert servers.scheduler_process is not None
                serving = await wait_serving(servers.scheduler, servers.scheduler_process, killed_at)
                serving_ms = killed_ms + serving.master * 1000
                with trio.move_on_after(STREAM_MS / 1000 + 60):
                    await all_in.wait()
                nursery.cancel_scope.cancel()
    lateness = [float(got - due) for due, got in received.values()]
    after_kill = [got for due, got in received.values() if due >= killed_ms]
    return RestartFigures(
        signal=how.name,
        exited=exited,
        serving=serving,
        first_due_received=(min(after_kill) - killed_ms) / 1000 if after_kill else -1.0,
        down_lateness=[float(got - due) for due, got in received.values() if killed_ms <= due <= serving_ms],
        lateness=lateness,
        lost=len(sent.keys() - received.keys()),
        early=sum(1 for late in lateness if late < 0),
    )


def restart_rows(figures: RestartFigures) -> list[Row]:
    name = figures.signal
    p50, p99, worst = percentiles(figures.down_lateness)
    _, all_p99, all_worst = percentiles(figures.lateness)
    return [
        (f"{name}: signal to the old process's exit", figures.exited * 1000, "ms"),
        (f"{name}: signal to STATUS answering", figures.serving.status * 1000, "ms"),
        (f"{name}: signal to serving as master", figures.serving.master * 1000, "ms"),
        (f"{name}: signal to first due message received", figures.first_due_received * 1000, "ms"),
        (f"{name}: messages due while down", len(figures.down_lateness), "msgs"),
        (f"{name}: their lateness p50", p50, "ms"),
        (f"{name}: their lateness p99", p99, "ms"),
        (f"{name}: their lateness max", worst, "ms"),
        (f"{name}: stream lateness p99 / max", all_p99, f"ms / {all_worst:,.0f} ms"),
        (f"{name}: lost / early", figures.lost, f"msgs / {figures.early} early"),
    ]


def bench_restart(
    scratch: Path, *, count: int | None = None, spread_days: int = 30, data: Path | None = None
) -> list[Row]:
    """Build (or reuse ``data``) a folder with ``count`` messages scheduled over ``spread_days``, then
    SIGKILL and SIGTERM the scheduler under a stream of due messages. ``count`` defaults to
    ``DELAYMQ_BENCH_RESTART_COUNT`` or 10 million (about three minutes to build on a 2-core machine)."""
    if count is None:
        count = int(os.environ.get("DELAYMQ_BENCH_RESTART_COUNT", "10000000"))
    rows: list[Row] = []
    if data is None:
        data = scratch / "scheduler"
        built = build_backlog(data, count, now_ms=int(time.time() * 1000), spread_ms=spread_days * 86_400_000)
        rows.append((f"build {count:,} messages over {spread_days} days", built, "s"))
    with running_servers(scratch, data) as servers:

        async def run() -> list[Row]:
            assert servers.scheduler_process is not None
            first = await wait_serving(servers.scheduler, servers.scheduler_process, time.perf_counter())
            found: list[Row] = [("first start to serving as master", first.master * 1000, "ms")]
            await wait_delivering(servers.meta)
            for how in (signal.SIGKILL, signal.SIGTERM):
                found += restart_rows(await restart_under_stream(servers, data, how))
            return found

        rows += trio.run(run)
    return rows


__all__ = ["bench_restart", "build_backlog"]
