"""NACK with a retry: re-addressed records go to a (fake) scheduler, or to the dead letters.

Driven with ``autojump_clock`` over in-memory connections: a real metaserver
routes ``delayed-producer`` to a fake scheduler that records SCHEDULE bodies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.routes import RouteClient
from delaymq.clock import TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.records import Message, decode_batch, encode_batch
from delaymq.realtime import open_realtime_server
from delaymq.realtime.dedup import dedup_key
from delaymq.realtime.index import Indexer
from delaymq.realtime.retries import SCHEDULE_DEADLINE_S
from delaymq.realtime.server import RealtimeServer
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import run_inline

EPOCH = 1_700_000_000_000
META = "meta:20880"
SCHEDULER = "scheduler-1:20890"


@dataclass
class FakeScheduler:
    """Records every SCHEDULE; refuses while ``refuse`` is set; answers after ``delay`` seconds."""

    refuse: str | None = None
    delay: float = 0.0
    batches: list[list[Message]] = field(default_factory=list)
    received_at: list[int] = field(default_factory=list)
    clock: TrioClock | None = None

    async def schedule(self, request: Request) -> dict[str, Any]:
        if self.delay:
            await trio.sleep(self.delay)
        if self.refuse:
            raise RemoteProtocolError("the scheduler refuses", code=self.refuse)
        messages = decode_batch(request.body)
        self.batches.append(messages)
        assert self.clock is not None
        self.received_at.append(self.clock.now_ms())
        return {"results": ["scheduled"] * len(messages)}

    @property
    def messages(self) -> list[Message]:
        return [message for batch in self.batches for message in batch]


@dataclass
class World:
    server: RealtimeServer
    scheduler: FakeScheduler
    clock: TrioClock
    rt: SimpleNamespace

    def client(self, **names: Any) -> Any:
        return self.rt.memory_client(self.server, **names)


@asynccontextmanager
async def world(
    tmp_path: Path, rt: SimpleNamespace, *, with_scheduler: bool = True, **options: Any
) -> AsyncIterator[World]:
    clock = TrioClock(EPOCH)
    scheduler = FakeScheduler(clock=clock)
    async with (
        open_metaserver(
            listen=None, data_dir=tmp_path / "meta", clock=clock, run_blocking=run_inline, evict_after_ms=3_600_000
        ) as meta,
        open_realtime_server(data_dir=tmp_path / "rt", clock=clock, run_blocking=run_inline, **options) as server,
    ):
        async with trio.open_nursery() as nursery:
            network = MemoryNetwork(nursery)
            network.serve(META, meta.serve_stream)
            if with_scheduler:
                network.serve(SCHEDULER, FrameServer({Command.SCHEDULE: scheduler.schedule}).serve_stream)
                info = {"group": "scheduler-1", "kind": "scheduler", "role": "master", "address": SCHEDULER}
                await network.call(META, Command.REGISTER, {**info, "version": "t"})
            server.scheduler_routes = RouteClient(network, [META], clock=clock)
            yield World(server, scheduler, clock, rt)
            nursery.cancel_scope.cancel()


async def nack(client: Any, start: int, end: int, **fields: Any) -> int:
    """A NACK with the retry fields (the shared test client sends plain ones)."""
    names = {"group": client.group, "consumer": client.consumer, "subject": client.subject}
    frame = await client._call(Command.NACK, {**names, "start": start, "end": end, **fields}, b"")
    return int(frame.metadata["acked"])


def message(message_id: str = "m1", subject: str = "orders", **options: Any) -> Message:
    options.setdefault("body", b"body of " + message_id.encode())
    return Message(message_id, subject, **options)


async def test_a_nack_with_a_delay_sends_the_retry_to_the_scheduler_and_settles_the_range(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with world(tmp_path, rt, ack_timeout_ms=5_000) as w, w.client(group="billing") as client:
        original = message(tags=("paid",), properties={"k": "v"}, deliver_at=EPOCH - 7, created_at=EPOCH - 9)
        await client.send([original, message("m2")])
        pulled = await client.pull(10, **{"from": "earliest"})
        nacked_at = w.clock.now_ms()
        assert await nack(client, pulled.start, pulled.start + 1, delay_ms=5_000, dead=False) == 1
        (retry,) = w.scheduler.messages
        assert (retry.id, retry.subject, retry.attempts) == ("m1", "%retry%billing%orders", 1)
        assert retry.deliver_at == nacked_at + 5_000
        assert (retry.tags, retry.properties, retry.body, retry.created_at) == (
            ("paid",), {"k": "v"}, b"body of m1", EPOCH - 9,
        )  # fmt: skip
        await client.ack(pulled.start + 1, pulled.end)
        # Settled: the ack timeout gives nothing back.
        assert (await client.pull(10, timeout_ms=20_000)).count == 0
        stats = w.server.statistics()
        assert (stats.retries_scheduled, stats.redeliveries, stats.nacks) == (1, 0, 1)


async def test_attempts_of_the_retry_count_every_earlier_delivery(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with world(tmp_path, rt, ack_timeout_ms=5_000) as w, w.client(group="billing") as client:
        await client.send([message(attempts=2)])  # as a scheduler delivers an earlier retry
        first = await client.pull(10, **{"from": "earliest"})
        again = await client.pull(10, timeout_ms=20_000)  # not acked: back after the ack timeout
        assert [m.attempts for m in first.messages + again.messages] == [2, 3]
        await nack(client, again.start, again.end, delay_ms=30_000)
        assert [m.attempts for m in w.scheduler.messages] == [4]


async def test_a_dead_nack_appends_to_the_dead_letter_subject_consumed_like_any_other(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        world(tmp_path, rt) as w,
        w.client(group="billing") as client,
        w.client(group="ops", subject="%dead%billing%orders") as ops,
    ):
        await client.send([message("m1"), message("m2")])
        pulled = await client.pull(10, **{"from": "earliest"})
        died_at = w.clock.now_ms()
        await nack(client, pulled.start, pulled.end, delay_ms=7_200_000, dead=True)
        assert w.scheduler.batches == []  # never through the scheduler
        dead = await ops.pull(10, **{"from": "earliest"})
        assert dead.ids == ["m1", "m2"]
        assert {(m.subject, m.attempts, m.deliver_at) for m in dead.messages} == {("%dead%billing%orders", 1, died_at)}
        assert dead.messages[0].body == b"body of m1"
        await ops.ack(dead.start, dead.end)
        assert (await client.pull(10)).count == 0
        assert w.server.statistics().dead_letters == 2


async def test_a_nack_on_the_retry_subject_keeps_it_and_dead_letters_name_the_original(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with world(tmp_path, rt) as w, w.client(group="billing", subject="%retry%billing%orders") as retries:
        await retries.send([message(name, "%retry%billing%orders", attempts=1) for name in "ab"])
        pulled = await retries.pull(10, **{"from": "earliest"})
        await nack(retries, pulled.start, pulled.start + 1, delay_ms=10_000)
        await nack(retries, pulled.start + 1, pulled.end, dead=True)
        assert [(m.subject, m.attempts) for m in w.scheduler.messages] == [("%retry%billing%orders", 2)]
        async with w.client(group="ops", subject="%dead%billing%orders") as ops:
            dead = await ops.pull(10, **{"from": "earliest"})
        assert [(m.id, m.attempts) for m in dead.messages] == [("b", 2)]


async def test_a_delay_of_zero_retries_at_once_through_the_own_log(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        world(tmp_path, rt) as w,
        w.client(group="billing") as client,
        w.client(group="billing", subject="%retry%billing%orders") as retries,
    ):
        await client.send([message()])
        pulled = await client.pull(10, **{"from": "earliest"})
        await nack(client, pulled.start, pulled.end, delay_ms=0)
        back = await retries.pull(10, **{"from": "earliest"})
        assert [(m.id, m.attempts) for m in back.messages] == [("m1", 1)]
        assert w.scheduler.batches == [] and w.server.statistics().retries_stored == 1


@pytest.mark.parametrize("trouble", ["refused", "no_scheduler", "no_routes"])
async def test_without_a_scheduler_the_nacked_message_is_given_back_at_once(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock, trouble: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    async with world(tmp_path, rt, with_scheduler=trouble != "no_scheduler") as w, w.client(group="g") as client:
        w.scheduler.refuse = "unavailable" if trouble == "refused" else None
        if trouble == "no_routes":
            w.server.scheduler_routes = None  # a server with no meta_address
        await client.send([message()])
        pulled = await client.pull(10, **{"from": "earliest"})
        start = trio.current_time()
        await nack(client, pulled.start, pulled.end, delay_ms=5_000)
        again = await client.pull(10, timeout_ms=1_000)
        assert trio.current_time() - start < 1
        assert [(m.id, m.subject, m.attempts) for m in again.messages] == [("m1", "orders", 1)]
        stats = w.server.statistics()
        assert (stats.retries_given_back, stats.retries_scheduled, stats.redeliveries) == (1, 0, 1)
    assert "given back at once" in caplog.text


async def test_a_scheduler_that_never_answers_holds_the_nack_for_the_deadline_only(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with world(tmp_path, rt) as w, w.client(group="g") as client:
        w.scheduler.delay = 3_600.0
        await client.send([message()])
        pulled = await client.pull(10, **{"from": "earliest"})
        start = trio.current_time()
        await nack(client, pulled.start, pulled.end, delay_ms=5_000)
        assert SCHEDULE_DEADLINE_S <= trio.current_time() - start < SCHEDULE_DEADLINE_S + 1
        again = await client.pull(10)
        assert [(m.id, m.attempts) for m in again.messages] == [("m1", 1)]
        assert w.server.statistics().retries_given_back == 1


async def test_a_retry_in_flight_is_neither_timed_out_nor_sent_twice(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        world(tmp_path, rt, ack_timeout_ms=2_000, consumer_timeout_ms=2_000) as w,
        w.client(group="g") as client,
        w.client(group="g", consumer="other") as other,
    ):
        await other.pull(timeout_ms=0)
        await client.send([message()])
        pulled = await client.pull(10)
        w.scheduler.delay = 3.0  # longer than both timeouts
        answers: list[int] = []

        async def nack_it() -> None:
            answers.append(await nack(client, pulled.start, pulled.end, delay_ms=60_000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(nack_it)
            await trio.sleep(1)
            nursery.start_soon(nack_it)  # a repeat while the first waits: nothing to do
            # The other consumer of the group gets nothing while the retry is placed.
            assert (await other.pull(10, timeout_ms=20_000)).count == 0
        assert len(w.scheduler.messages) == 1 and answers == [0, 1]
        assert w.server.statistics().redeliveries == 0


async def test_retries_are_not_duplicates_of_the_original_but_scheduler_resends_are(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with world(tmp_path, rt) as w, w.client() as producer:
        assert await producer.send([message("m1")]) == ["stored"]
        billing = message("m1", "%retry%billing%orders", attempts=1)
        audit = message("m1", "%retry%audit%orders", attempts=1)
        assert await producer.send([billing, audit]) == ["stored", "stored"]
        assert await producer.send([billing, message("m1", "%retry%billing%orders", attempts=2)]) == [
            "duplicate", "stored",
        ]  # fmt: skip
        assert await producer.send([message("m1")]) == ["duplicate"]


async def test_replay_after_a_crash_readds_the_retry_dedup_keys(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path / "messages")
    try:
        log.append(encode_batch([message("m1"), message("m1", "%retry%g%orders", attempts=3)]))
        keys: list[str] = []
        indexer = Indexer(tmp_path, indexed_offset=0, on_ids=lambda ids, *_: keys.extend(ids))
        indexer.replay(log, EPOCH)
        indexer.close()
    finally:
        log.close()
    assert keys == [dedup_key("m1", "orders", 0), dedup_key("m1", "%retry%g%orders", 3)]
    assert keys[1] != dedup_key("m1", "%retry%other%orders", 3)


@pytest.mark.parametrize(
    ("command", "fields", "field", "code"),
    [
        (Command.PULL, {"group": "a%b", "max": 1}, "group", "bad_value"),
        (Command.NACK, {"group": "a%b", "start": 0, "end": 1}, "group", "bad_value"),
        (Command.CONSUMER_HEARTBEAT, {"group": "a%b", "subjects": ["orders"]}, "group", "bad_value"),
        (Command.NACK, {"start": 0, "end": 1, "dead": "yes"}, "dead", "bad_value"),
        (Command.NACK, {"start": 0, "end": 1, "delay_ms": -5}, "delay_ms", "limit"),
        (Command.NACK, {"start": 0, "end": 1, "delay_ms": 5, "subject": "s" * 250}, "subject", "limit"),
    ],
)
async def test_bad_retry_requests_are_refused_naming_the_field(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock,
    command: Command, fields: dict[str, Any], field: str, code: str,
) -> None:  # fmt: skip
    async with world(tmp_path, rt, with_scheduler=False) as w, w.client(group="g") as client:
        metadata: dict[str, Any] = {"group": "g", "consumer": "c", "subject": "orders", **fields}
        if command is Command.CONSUMER_HEARTBEAT:
            metadata.pop("subject")
        with pytest.raises(PeerError) as refused:
            await client._call(command, metadata, b"")
        assert (refused.value.field, refused.value.code) == (field, code)
