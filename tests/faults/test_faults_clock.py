"""A real cluster process whose wall clock steps back ten minutes, then forward again.

The cluster's wall clock (``time.time``, ``time.time_ns``) is real time plus an offset
the test writes to a file, its monotonic clock is left alone: the way an admin or NTP
steps a machine's clock (a ``sitecustomize`` in the child does it, not libfaketime, whose
``FAKETIME_DONT_FAKE_MONOTONIC`` mode delays the child's thread wake-ups by up to
seconds, which would measure libfaketime, not delaymq). The producer
and the consumer use a clock stepped the same way (the same machine). Heartbeats must
go on (nobody evicted, routes answered throughout), a message must be due when the
(stepped) wall clock reads its moment, never earlier, and within about a second after;
a step back that is corrected must be followed within a second; each server process that
notices a step logs it once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.bench.cluster import local_cluster
from delaymq.client import open_consumer, open_producer
from delaymq.clock import SystemClock
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command

pytestmark = pytest.mark.faults

SUBJECT = "clock"
STEP_S = 600
#: How soon after its moment (by the stepped wall clock) a message must arrive.
WITHIN_MS = 1_000  # the wall clock is looked at every half second; the rest is the machine

#: Loaded by the child at start-up: its wall clock follows the offset in the file.
SITECUSTOMIZE = """
import os, threading, time

_path = os.environ["DELAYMQ_TEST_WALL_OFFSET_FILE"]
_real_time_ns = time.time_ns
_offset_ns = 0


def _follow():
    global _offset_ns
    seen = None
    while True:
        try:
            with open(_path) as file:
                text = file.read()
            _offset_ns = int(text) * 1_000_000_000
            if text != seen:  # tell the test this process now runs on the new offset
                with open(f"{_path}.seen.{os.getpid()}", "w") as mark:
                    mark.write(text)
                seen = text
        except (OSError, ValueError):
            pass
        time.sleep(0.005)


def _time_ns():
    return _real_time_ns() + _offset_ns


_follow_once = threading.Thread(target=_follow, daemon=True)
_follow_once.start()
time.time_ns = _time_ns
time.time = lambda: _time_ns() / 1e9
"""


class SteppedWallClock:
    """The machine's wall clock: real time plus an offset in seconds kept in a file (the
    cluster follows it within 5 ms), and the same clock for the clients here."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.folder = folder
        self.path = folder / "offset"
        self.offset_s = 0
        self.path.write_text("0")
        self.clock = SystemClock(wall_ns=lambda: time.time_ns() + self.offset_s * 1_000_000_000)

    async def step_to(self, offset_s: int) -> None:
        """Step both clocks; return once every process of the cluster says it follows."""
        temp = self.path.with_suffix(".tmp")
        temp.write_text(str(offset_s))
        temp.replace(self.path)
        self.offset_s = offset_s
        marks = list(self.folder.glob("offset.seen.*"))
        assert marks, "no cluster process follows the offset file"
        with trio.fail_after(5):
            while any(mark.read_text() != str(offset_s) for mark in marks):
                await trio.sleep(0.005)  # polling the children's marks, bounded above

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(self.folder), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "PYTHONPATH": path, "DELAYMQ_TEST_WALL_OFFSET_FILE": str(self.path)}


async def test_a_cluster_whose_wall_clock_steps_back_ten_minutes_and_forward_keeps_heartbeats_and_due_times(
    tmp_path: Path, fault_report: Any
) -> None:
    wall = SteppedWallClock(tmp_path / "wall")
    clock = wall.clock
    received: dict[str, list[int]] = {}
    arrived = trio.Event()
    log_path = tmp_path / "cluster.log"

    async def consume(consumer: Any) -> None:
        nonlocal arrived
        async for message in consumer:
            received.setdefault(message.id, []).append(message.received_at)
            await message.ack()
            arrived.set()
            arrived = trio.Event()

    async def wait_for(message_id: str, seconds: float) -> int:
        with trio.fail_after(seconds):
            while message_id not in received:
                await arrived.wait()
        return received[message_id][0]

    with (
        open(log_path, "w") as log,
        local_cluster(tmp_path / "cluster", flush="sync", env=wall.env(), stderr=log) as cluster,
    ):
        async with (
            open_peers() as peers,
            open_producer(cluster.meta, clock=clock) as producer,
            open_consumer(cluster.meta, SUBJECT, group="g", start="earliest", clock=clock) as consumer,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(consume, consumer)
            before_step = await producer.send(SUBJECT, "due in 20 s", delay=20)
            before_due = clock.now_ms() + 20_000  # within a few ms of the message's own
            await trio.sleep(3)

            await wall.step_to(-STEP_S)  # back ten minutes
            stepped_back = trio.current_time()
            after_step = producer.message(SUBJECT, "due in 5 s, by the new wall clock", delay=5)
            await producer.send_batch([after_step])

            # Forty seconds (beyond the 30 s eviction): routes answered, heartbeats fresh.
            worst_silence = 0.0
            while trio.current_time() - stepped_back < 40:
                for route in ("delayed-producer", "immediate-producer", "consumer"):
                    answer = await peers.call(cluster.meta, Command.ROUTE, {"route": route})
                    assert answer.metadata["groups"], (
                        f"{route} routes nothing {trio.current_time() - stepped_back:.1f} s after the step"
                    )
                rows = (await peers.call(cluster.meta, Command.STATUS, {})).metadata["rows"]
                assert not any(row["evicted"] for row in rows), rows
                worst_silence = max(worst_silence, *(row["seconds_since_heartbeat"] for row in rows))
                await trio.sleep(1)  # sampling the routes once a second, not synchronising
            after_received = await wait_for(after_step.id, 1)  # due ~35 s ago by the new wall clock
            assert before_step not in received  # its moment is ten minutes away by the new wall clock

            await wall.step_to(0)  # corrected: 25 s past the first message's moment
            corrected = clock.now_ms()
            before_received = await wait_for(before_step, 10)
            on_time = producer.message(SUBJECT, "due in 2 s, after the correction", delay=2)
            await producer.send_batch([on_time])
            on_time_received = await wait_for(on_time.id, 10)
            nursery.cancel_scope.cancel()

    cluster_log = log_path.read_text()
    correction_delay = before_received - corrected
    after_lateness = after_received - after_step.deliver_at
    on_time_lateness = on_time_received - on_time.deliver_at
    fault_report.record(
        lost=0,
        early=sum(lateness < 0 for lateness in (after_lateness, on_time_lateness, before_received - before_due)),
        duplicated=sum(len(times) - 1 for times in received.values()),
        lateness_after_step_back_ms=after_lateness,
        lateness_after_correction_ms=on_time_lateness,
        delivery_after_correction_ms=correction_delay,
        max_heartbeat_silence_s=round(worst_silence, 1),
        step_warnings=cluster_log.count("the wall clock stepped"),
    )
    assert 0 <= after_lateness <= WITHIN_MS  # due by the stepped wall clock, not the old one
    assert 0 <= correction_delay <= WITHIN_MS
    assert before_received >= before_due
    assert 0 <= on_time_lateness <= WITHIN_MS
    assert worst_silence < 10  # heartbeats every 5 s throughout
    for step in ("back", "forward"):  # once by each server process that noticed it (lines "[server] ...")
        said = f"the wall clock stepped {step} by 600"
        noticed = [line.split("]")[0] for line in cluster_log.splitlines() if said in line]
        assert noticed and len(noticed) == len(set(noticed)), cluster_log
    assert all(len(times) == 1 for times in received.values())
