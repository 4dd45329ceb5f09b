"""A message log damaged below the index checkpoint: the server starts from the last intact record.

Real damage is written into the segment files of a cleanly stopped server (a
segment cut in its middle, a flipped byte in an early record, a segment
deleted); the server must start, deliver every message before the damage to
old and new groups, take new sends, and log one warning naming what was lost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.clock import TrioClock
from delaymq.protocol.records import Message, decode_batch
from delaymq.realtime import open_realtime_server
from delaymq.storage.log import SegmentedLog, segment_name
from delaymq.storage.threads import run_inline

EPOCH = 1_700_000_000_000
BATCHES, PER_BATCH = 6, 10
SMALL_SEGMENTS = 4096  # one batch of ten ~270-byte records per segment


@dataclass(frozen=True)
class Stored:
    """One record of the message log as the test found it on disk."""

    id: str
    offset: int
    end: int


@dataclass(frozen=True)
class Damage:
    """Where the log now ends (the first lost offset) and the files it was done to."""

    new_end: int


def message_log_records(messages: Path, segment_size: int) -> list[Stored]:
    log = SegmentedLog.open(messages, segment_size=segment_size)
    try:
        stored = []
        for record in log.iter_from(log.start_offset):
            raw, _next = log.read_raw(record.offset, 1)
            stored.append(Stored(decode_batch(raw)[0].id, record.offset, record.next_offset))
        return stored
    finally:
        log.close()


def segments(messages: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.name), p) for p in messages.iterdir() if p.name.isdigit())


def cut_a_middle_segment_in_its_middle(messages: Path, records: list[Stored]) -> Damage:
    files = segments(messages)
    base, path = files[len(files) // 2]
    assert (base, path) != files[-1]
    cut = base + path.stat().st_size // 2 + 7  # inside a record: the log cuts its torn tail
    assert cut not in {r.end for r in records}
    os.truncate(path, cut - base)
    return Damage(max([r.end for r in records if r.end <= cut], default=base))


def flip_a_byte_in_an_early_record(messages: Path, records: list[Stored]) -> Damage:
    victim = records[3]
    ((base, path),) = segments(messages)  # one segment: the log checks it whole on open
    with open(path, "r+b") as file:
        file.seek(victim.end - 5 - base)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x40]))
    return Damage(victim.offset)


def delete_the_last_segment(messages: Path, records: list[Stored]) -> Damage:
    base, path = segments(messages)[-1]
    path.unlink()
    return Damage(base)


def delete_a_middle_segment(messages: Path, records: list[Stored]) -> Damage:
    files = segments(messages)
    base, path = files[len(files) // 2]
    path.unlink()
    return Damage(base)


@pytest.mark.parametrize(
    ("damage", "segment_size"),
    [
        (cut_a_middle_segment_in_its_middle, SMALL_SEGMENTS),
        (flip_a_byte_in_an_early_record, 1 << 30),
        (delete_the_last_segment, SMALL_SEGMENTS),
        (delete_a_middle_segment, SMALL_SEGMENTS),
    ],
)
async def test_damage_below_the_checkpoint_loses_only_what_follows_it(
    tmp_path: Path,
    rt: SimpleNamespace,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path, list[Stored]], Damage],
    segment_size: int,
) -> None:
    clock = TrioClock(EPOCH)
    options: dict[str, Any] = dict(
        data_dir=tmp_path, clock=clock, run_blocking=run_inline, segment_size=segment_size, ack_timeout_ms=5_000
    )
    sent = [Message(f"m{i:03d}", "orders", body=f"body {i} ".encode() * 24) for i in range(BATCHES * PER_BATCH)]
    total = len(sent)
    async with open_realtime_server(**options) as server:
        async with (
            rt.memory_client(server, group="old", consumer="o") as old,
            rt.memory_client(server, group="holder", consumer="h") as holder,
        ):
            for start in range(0, total, PER_BATCH):
                assert await old.send(sent[start : start + PER_BATCH]) == ["stored"] * PER_BATCH
            taken = await old.pull(20, **{"from": "earliest"})
            await old.ack(taken.start, taken.end)
            held = await holder.pull(total, **{"from": "earliest"})
            assert held.count == total
            await holder.ack(0, total - 10)
            await holder.nack(total - 5, total)  # given back; [total - 10, total - 5) in flight
    records = message_log_records(tmp_path / "messages", segment_size)
    assert [r.id for r in records] == [m.id for m in sent]
    old_end = records[-1].end

    done = damage(tmp_path / "messages", records)
    intact = [r.id for r in records if r.end <= done.new_end]
    lost = [r.id for r in records if r.end > done.new_end]
    assert intact and lost
    bodies = {m.id: m.body for m in sent}

    caplog.clear()
    caplog.set_level(logging.INFO, logger="delaymq")
    async with open_realtime_server(**options) as server:
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("delaymq.realtime") and r.levelno >= logging.WARNING
        ]
        assert len(warnings) == 1, warnings
        assert (
            f"lost offsets [{done.new_end}, {old_end}) ({old_end - done.new_end} bytes, {len(lost)} record(s))"
            in (warnings[0])
        )
        assert server.statistics().message_log_end == done.new_end
        async with (
            rt.memory_client(server, group="old", consumer="o") as old,
            rt.memory_client(server, group="fresh", consumer="f") as fresh,
            rt.memory_client(server, group="holder", consumer="h") as holder,
            rt.memory_client(server, group="holder", consumer="h2") as holder2,
        ):
            # Its hand-outs in flight point at lost records (some of them): acking them is
            # harmless, and those of lost records count as settled.
            still_held = [p for p in range(total - 8, total - 5) if sent[p].id in intact]
            assert await holder.ack(total - 10, total - 8) == min(still_held, default=total)
            new = [Message(f"new{i}", "orders", body=b"after the damage") for i in range(5)]
            assert await fresh.send(new) == ["stored"] * 5
            everything = await fresh.pull(1000, **{"from": "earliest"})
            assert everything.ids == intact + [m.id for m in new]
            assert [m.body for m in everything.messages] == [bodies.get(i, b"after the damage") for i in everything.ids]
            assert {m.attempts for m in everything.messages} == {0}
            resumed = await old.pull(1000)
            assert resumed.ids == intact[20:] + [m.id for m in new]
            # The holder group: its new messages at once; what it held and what it gave
            # back comes back (attempts raised) only if its record survived.
            got: dict[str, int] = {}
            want = {m.id for m in new} | (set(intact) & {m.id for m in sent[total - 8 :]})
            while not want <= got.keys():
                pulled = await holder2.pull(100, timeout_ms=30_000)
                for message in pulled.messages:
                    assert message.id not in got and message.id in want, message.id
                    got[message.id] = message.attempts
                if pulled.count:
                    await holder2.ack(pulled.start, pulled.end)
            assert got == dict.fromkeys((m.id for m in new), 0) | dict.fromkeys(want - {m.id for m in new}, 1)
            assert (await holder2.pull(100, timeout_ms=120_000)).count == 0
    # Restarted once more: nothing to repair, nothing logged.
    caplog.clear()
    async with open_realtime_server(**options) as server:
        assert not [r for r in caplog.records if r.name.startswith("delaymq.realtime") and r.levelno >= logging.WARNING]
        async with rt.memory_client(server, group="again", consumer="a") as again:
            assert (await again.pull(1000, **{"from": "earliest"})).ids == intact + [m.id for m in new]


def test_moved_aside_segments_keep_their_bytes(tmp_path: Path) -> None:
    """The segments after a hole are renamed, not deleted, and the log opens without them."""
    from delaymq.realtime.recovery import move_aside_after_gap

    messages = tmp_path / "messages"
    log = SegmentedLog.open(messages, segment_size=64)
    for i in range(4):
        log.append_record(1, bytes([i]) * 40)
    log.close()
    files = segments(messages)
    assert len(files) == 4
    files[1][1].unlink()
    found = move_aside_after_gap(messages)
    assert found.gap_at == files[1][0]
    assert found.moved_aside == tuple(f"{segment_name(base)}.lost" for base, _ in files[2:])
    assert found.disk_end == files[-1][0] + files[-1][1].with_name(f"{files[-1][1].name}.lost").stat().st_size
    log = SegmentedLog.open(messages, segment_size=64)
    try:
        assert log.end_offset == files[1][0]
    finally:
        log.close()


async def test_a_flipped_byte_in_an_older_segment_costs_that_record_only(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Not looked for at start (that would read the whole log): found when a PULL reads it."""
    clock = TrioClock(EPOCH)
    options: dict[str, Any] = dict(data_dir=tmp_path, clock=clock, run_blocking=run_inline, segment_size=SMALL_SEGMENTS)
    sent = [Message(f"m{i:03d}", "orders", body=f"body {i} ".encode() * 24) for i in range(BATCHES * PER_BATCH)]
    async with open_realtime_server(**options) as server:
        async with rt.memory_client(server) as client:
            for start in range(0, len(sent), PER_BATCH):
                assert await client.send(sent[start : start + PER_BATCH]) == ["stored"] * PER_BATCH
    records = message_log_records(tmp_path / "messages", SMALL_SEGMENTS)
    victim = records[3]
    base, first = segments(tmp_path / "messages")[0]
    assert victim.end <= base + first.stat().st_size  # in the first of several segments
    with open(first, "r+b") as file:
        file.seek(victim.end - 5 - base)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x40]))

    caplog.set_level(logging.WARNING, logger="delaymq")
    caplog.clear()
    async with open_realtime_server(**options) as server:
        for group in ("g1", "g2"):
            async with rt.memory_client(server, group=group) as client:
                got = []
                while True:
                    pulled = await client.pull(7, **{"from": "earliest"})
                    if not pulled.count:
                        break
                    got += pulled.messages
                    await client.ack(pulled.start, pulled.end)
                assert [m.id for m in got] == [m.id for m in sent if m.id != victim.id]
                assert [m.body for m in got] == [m.body for m in sent if m.id != victim.id]
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 2, warnings  # once per group
        assert all(f"offsets {victim.offset} do not check" in w for w in warnings)
