"""An in-memory cluster for the scheduler tests: metaserver, realtime servers, scheduler.

Every server is the real one; only the network is replaced by ``MemoryNetwork``
(``trio.testing.memory_stream_pair`` per connection), and every blocking call runs
inline (``run_blocking=run_inline``), so the tests run under ``autojump_clock``: a two-year schedule takes
milliseconds, and time moves only when every task waits for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.producer import Producer
from delaymq.client.registration import run_registration
from delaymq.client.routes import RouteClient
from delaymq.clock import Clock, TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net import testing
from delaymq.net.connection import TransportError
from delaymq.net.limits import Limits
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.frames import Frame
from delaymq.protocol.records import encode_message, scan_batch
from delaymq.realtime.server import RealtimeServer, open_realtime_server
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.server import Scheduler, open_scheduler
from delaymq.storage.log import DEFAULT_SEGMENT_SIZE, SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.storage.threads import run_inline

from ..support.tasks import start_in_nursery

META = "meta.test:1"
SCHEDULER = "scheduler.test:1"
#: 2025-06-15 14:00:00 UTC, an hour boundary: tests start here.
EPOCH_MS = 1_749_996_000_000
DAY_MS = 86_400_000


class MemoryNetwork(testing.MemoryNetwork):
    """The shared in-memory network, plus ``after_send``: a hook run after a SEND
    answer came back and before the caller sees it (crash tests)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        super().__init__(nursery, timeout=30)
        self.after_send: Callable[[str, Frame], Awaitable[None]] | None = None

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Frame:  # fmt: skip
        answer = await super().call(address, command, metadata, body, timeout=timeout)
        if command == Command.SEND and self.after_send is not None:
            await self.after_send(address, answer)
        return answer


@dataclass
class Received:
    id: str
    deliver_at: int
    received_at: int


@dataclass
class Receiver:
    """A consumer of one subject on every realtime group: long polls, acks at once."""

    net: MemoryNetwork
    clock: Clock
    subject: str = "orders"
    group: str = "g"
    poll_ms: int = 60_000
    got: list[Received] = field(default_factory=list)
    _changed: trio.Event = field(default_factory=trio.Event)

    async def pull_forever(self, address: str) -> None:
        while True:
            await self.pull_once(address)

    async def receive_until(self, address: str, count: int) -> list[Received]:
        """Pull (long polls) from one server until ``count`` messages are in."""
        while len(self.got) < count:
            await self.pull_once(address)
        return self.got

    async def pull_once(self, address: str) -> None:
        base = {"group": self.group, "consumer": "c1", "subject": self.subject}
        try:
            frame = await self.net.call(
                address, Command.PULL, {**base, "max": 10_000, "timeout_ms": self.poll_ms, "from": "earliest"},
                timeout=self.poll_ms / 1000 + 30,
            )  # fmt: skip
        except (TransportError, PeerError):
            await trio.sleep(1)  # the server is away: look again later
            return
        now = self.clock.now_ms()
        count = frame.metadata["count"]
        if not count:
            return
        batch = scan_batch(frame.body)
        self.got.extend(Received(i, at, now) for i, at in zip(batch.ids, batch.deliver_ats))
        self._changed.set()
        self._changed = trio.Event()
        start = frame.metadata["pull_start"]
        await self.net.call(address, Command.ACK, {**base, "start": start, "end": start + count})

    async def wait_for(self, count: int) -> list[Received]:
        while len(self.got) < count:
            await self._changed.wait()
        return self.got

    def ids(self) -> list[str]:
        return [r.id for r in self.got]


@dataclass
class Cluster:
    """A metaserver, realtime servers and (while open) a scheduler on a ``MemoryNetwork``."""

    tmp: Path
    clock: Clock
    net: MemoryNetwork
    nursery: trio.Nursery
    options: dict[str, Any]
    realtime: dict[str, RealtimeServer] = field(default_factory=dict)
    _realtime_scopes: dict[str, trio.CancelScope] = field(default_factory=dict)

    def producer(self, **options: Any) -> Producer:
        routes = RouteClient(self.net, [META], clock=self.clock)
        settings = {
            "limits": Limits(),
            "batch_bytes": 1 << 20,
            "batch_messages": 10_000,
            "attempts": 3,
            "timeout": 30.0,
        }
        return Producer(routes, clock=self.clock, **{**settings, **options})

    def receiver(self, subject: str = "orders", **options: Any) -> Receiver:
        """A consumer pulling from every realtime server, from now on."""
        receiver = Receiver(self.net, self.clock, subject, **options)
        for name in self.realtime:
            self.nursery.start_soon(receiver.pull_forever, f"{name}.test:1")
        return receiver

    def receiver_idle(self, subject: str = "orders", **options: Any) -> Receiver:
        """A consumer that pulls only when told (``receive_until``)."""
        return Receiver(self.net, self.clock, subject, **options)

    async def start_realtime(self, name: str = "rt1", **options: Any) -> RealtimeServer:
        """A realtime server registered under ``NAME.test:1`` (restarted on the same data)."""
        settings = {
            "checkpoint_interval_ms": self.options.get("rt_checkpoint_ms", 60_000),
            "run_blocking": run_inline,
            **options,
        }
        started: RealtimeServer = await self.nursery.start(partial(self._run_realtime, name, settings))
        return started

    async def _run_realtime(self, name: str, settings: dict[str, Any], *, task_status: Any) -> None:
        address = f"{name}.test:1"
        with trio.CancelScope() as scope:
            self._realtime_scopes[name] = scope
            async with open_realtime_server(data_dir=self.tmp / name, clock=self.clock, group=name, **settings) as rt:
                self.realtime[name] = rt
                self.net.serve(address, rt.serve_stream)
                info = {"group": name, "kind": "realtime", "role": "master", "address": address, "version": "test"}
                async with trio.open_nursery() as nursery:
                    await nursery.start(
                        partial(run_registration, self.net, meta_address=META, info=info, clock=self.clock)
                    )
                    task_status.started(rt)
                    await trio.sleep_forever()

    def stop_realtime(self, name: str = "rt1") -> None:
        """Take a realtime server off the network and close it."""
        self.net.remove(f"{name}.test:1")
        self._realtime_scopes.pop(name).cancel()

    @asynccontextmanager
    async def scheduler(self, address: str = SCHEDULER, **options: Any) -> AsyncIterator[Scheduler]:
        """The scheduler on its data folder (open it again to restart it); another
        ``address`` is another member of the group, on a folder of its own."""
        settings = {
            "data_dir": self.tmp / ("scheduler" if address == SCHEDULER else address),
            "clock": self.clock,
            "listen": None,
            "advertise_address": address,
            "meta_address": META,
            "run_blocking": run_inline,
            "peers": self.net,
            **self.options.get("scheduler", {}),
            **options,
        }
        async with open_scheduler(**settings) as scheduler:
            self.net.serve(address, scheduler.serve_stream)
            try:
                yield scheduler
            finally:
                self.net.remove(address)

    async def start_member(self, address: str, **options: Any) -> Scheduler:
        """A member (``scheduler(address, **options)``) in the cluster's nursery: its ``crash()`` ends only its own task."""
        member: Scheduler = await start_in_nursery(self.nursery, self.scheduler(address, **options))
        return member

    async def schedule_raw(self, records: list[bytes]) -> Frame:
        """SCHEDULE straight to the scheduler, past the producer's own checks."""
        return await self.net.call(SCHEDULER, Command.SCHEDULE, {}, b"".join(records))


@asynccontextmanager
async def open_cluster(
    tmp: Path, *, realtime: tuple[str, ...] = ("rt1",), clock: Clock | None = None, **options: Any
) -> AsyncIterator[Cluster]:
    """``options``: ``meta`` (open_metaserver options), ``scheduler`` (defaults for
    open_scheduler), ``rt_checkpoint_ms``. ``clock``: every server's (default: a
    ``TrioClock`` at ``EPOCH_MS``)."""
    clock = clock or TrioClock(EPOCH_MS)
    async with AsyncExitStack() as stack:
        meta_options = {"run_blocking": run_inline, **options.get("meta", {})}
        meta = await stack.enter_async_context(
            open_metaserver(listen=None, data_dir=tmp / "meta", clock=clock, **meta_options)
        )
        nursery = await stack.enter_async_context(trio.open_nursery())
        net = MemoryNetwork(nursery)
        net.serve(META, meta.serve_stream)
        cluster = Cluster(tmp, clock, net, nursery, options)
        for name in realtime:
            await cluster.start_realtime(name)
        try:
            yield cluster
        finally:
            nursery.cancel_scope.cancel()


@contextmanager
def schedule_folder(
    root: Path, *, segment_size: int = DEFAULT_SEGMENT_SIZE, **store_options: Any
) -> Iterator[tuple[SegmentedLog, ScheduleStore]]:
    """A scheduler's data folder: its message log and its schedule store (on its own lmdb), closed in turn."""
    with (
        SegmentedLog.open(root / "messages", segment_size=segment_size) as log,
        StateStore.open(root / "state") as state,
        ScheduleStore.open(root / "schedule", state, **store_options) as store,
    ):
        yield log, store


def message(name: str, deliver_at: int, *, subject: str = "orders", created_at: int = EPOCH_MS) -> bytes:
    return encode_message(name, subject, body=name.encode(), deliver_at=deliver_at, created_at=created_at)


@pytest.fixture
def sched() -> SimpleNamespace:
    """The helpers above, for the scheduler's tests."""
    return SimpleNamespace(
        open_cluster=open_cluster, folder=schedule_folder, message=message,
        EPOCH_MS=EPOCH_MS, DAY_MS=DAY_MS, SCHEDULER=SCHEDULER,
    )  # fmt: skip


#: Meta heartbeats, cleanup and checkpoints a day apart: tests that jump the clock far see only what they ask for.
QUIET = {
    "meta": {
        "heartbeat_interval_ms": 86_400_000,
        "evict_after_ms": 3 * 86_400_000,
        "check_interval_ms": 86_400_000,
        "failover_after_ms": 5 * 86_400_000,
    },
    "scheduler": {"cleanup_interval_ms": 86_400_000},
    "rt_checkpoint_ms": 86_400_000,
}
