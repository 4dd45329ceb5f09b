"""``producer.query`` asks the scheduler groups, then the realtime groups: which realtime
group stored a delivered message and what each consumer group did with it.

A real metaserver, realtime server and scheduler in-process on a ``MemoryNetwork``
under ``autojump_clock`` (as tests/client/test_client_cancel_e2e.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.cli.scheduled_command import as_text
from delaymq.client.producer import open_producer
from delaymq.client.scheduled import Location, MessageState, with_locations
from delaymq.clock import TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import open_scheduler
from delaymq.storage.threads import run_inline

EPOCH = 1_767_304_800_000
META = "meta.test:20880"
SCHEDULER = "sched-a.test:1"
MINUTE = 60_000


@asynccontextmanager
async def open_cluster(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Any, MemoryNetwork, str]]:
    """(clock, network, realtime address) of a metaserver, realtime group rt1 and one scheduler."""
    clock = TrioClock(EPOCH)
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        net = MemoryNetwork(nursery, timeout=60)
        monkeypatch.setattr(trio, "open_tcp_stream", net.open_tcp_stream)
        meta = await stack.enter_async_context(
            open_metaserver(listen=None, data_dir=tmp / "meta", clock=clock, run_blocking=run_inline)
        )
        net.serve(META, meta.serve_stream)
        realtime = await stack.enter_async_context(
            open_realtime_server(data_dir=tmp / "rt1", clock=clock, group="rt1", meta_address=META,
                                 run_blocking=run_inline)
        )  # fmt: skip
        net.serve(realtime.address, realtime.serve_stream)
        scheduler = await stack.enter_async_context(
            open_scheduler(data_dir=tmp / "sched", clock=clock, listen=None, advertise_address=SCHEDULER,
                           meta_address=META, run_blocking=run_inline)
        )  # fmt: skip
        net.serve(SCHEDULER, scheduler.serve_stream)
        yield clock, net, realtime.address


async def test_query_of_a_delayed_message_after_delivery_names_the_realtime_group_and_each_consumer_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        open_cluster(tmp_path, monkeypatch) as (clock, net, realtime),
        open_producer(META, clock=clock, send_timeout=60, peers=net) as producer,
    ):

        async def pull(group: str, timeout_ms: int) -> Any:
            metadata = {"group": group, "consumer": "c1", "subject": "reminders", "max": 10, "timeout_ms": timeout_ms}
            return await net.call(realtime, Command.PULL, {**metadata, "from": "earliest"}, timeout=120)

        assert (await pull("audit", 0)).metadata["count"] == 0  # reads the subject, never takes anything
        due = clock.now_ms() + 10 * MINUTE
        sent = await producer.send("reminders", "call back", at=due, id="reminder-1")
        later = await producer.send("reminders", "later", at=due + 60 * MINUTE, id="reminder-2")
        old_id = await producer.send("reminders", "at once", id="immediate-old")

        [waiting] = await producer.query(sent, group=sent.group)
        assert (waiting.state, waiting.realtime_group, waiting.consumer_groups) == ("scheduled", None, None)

        with trio.fail_after(3600):
            body = b""
            while b"reminder-1" not in body:
                frame = await pull("billing", 60_000)
                start, count, body = frame.metadata["pull_start"], frame.metadata["count"], frame.body
                if count:
                    await net.call(realtime, Command.ACK, {"group": "billing", "consumer": "c1",
                                                           "subject": "reminders", "start": start,
                                                           "end": start + count})  # fmt: skip
        assert clock.now_ms() >= due
        now_id = await producer.send("reminders", "at once", id="immediate-1")

        delivered, scheduled, immediate, old = await producer.query([sent, later, now_id, old_id])

    assert delivered.state == "delivered" and delivered.group == sent.group
    assert delivered.realtime_group == "rt1"
    assert delivered.consumer_groups == {"audit": "waiting", "billing": "acked"}
    assert delivered.as_dict()["consumer_groups"] == {"audit": "waiting", "billing": "acked"}
    assert (scheduled.state, scheduled.realtime_group, scheduled.consumer_groups) == ("scheduled", None, None)
    # An immediate message: no scheduler group knows it; realtime group rt1 stored it.
    assert (immediate.state, immediate.group, immediate.realtime_group) == ("delivered", None, "rt1")
    assert immediate.consumer_groups == {"audit": "waiting", "billing": "waiting"}
    # Stored longer ago than the realtime group's dedup window (10 minutes): it no longer says.
    assert (old.state, old.realtime_group, old.consumer_groups) == ("unknown", None, None)


def test_a_realtime_location_fills_in_delivered_and_unknown_states_only() -> None:
    states = [MessageState("a", "delivered", group="s1"), MessageState("b", "unknown"), MessageState("c", "unknown")]
    where = Location("a", "rt2", "orders", 56, {"g": "handed out"})
    merged = with_locations(states, {"a": where, "b": Location("b", "rt1", "orders", 0, {})})
    assert merged[0] == MessageState(
        "a", "delivered", group="s1", realtime_group="rt2", consumer_groups={"g": "handed out"}
    )
    assert (merged[1].state, merged[1].realtime_group, merged[1].consumer_groups) == ("delivered", "rt1", {})
    assert merged[2] == states[2]


def test_delaymq_query_prints_the_realtime_group_and_each_consumer_group_on_the_line() -> None:
    state = MessageState(
        "a", "delivered", group="s1", realtime_group="rt1", consumer_groups={"audit": "handed out", "billing": "acked"}
    )
    assert as_text(state) == "a delivered group=s1 realtime_group=rt1 consumer_groups=audit:handed-out,billing:acked"
