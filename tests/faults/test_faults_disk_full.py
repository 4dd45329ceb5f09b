"""A real full disk under a realtime server: refused while full, everything delivered after, no restart.

A small tmpfs (root only; skipped otherwise) holds the server's data folder and
a filler file that leaves a little room. Producers send under load until the
disk fills. Where it fills decides what they see:

- ``all``: the whole data folder. SENDs are answered ``unavailable`` and each
  refused batch is retried until it is stored (never answered ``duplicate``).
- ``consume``: only the consume logs (a second tiny tmpfs mounted on
  ``consume/``). SENDs are stored (the message log has room) and the index step
  stalls: nothing is delivered until space comes back, then all of it is.

The disk stays full for ``DELAYMQ_DISK_FULL_HOLD_S`` seconds (default 5; a
minute, 60, is the case an operator meets), then the filler is deleted. The same server process, never
restarted, must then deliver every acknowledged message: none lost, none twice.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from delaymq.net.peers import Peers, open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import Message, decode_batch, encode_batch
from delaymq.storage.testing import TmpfsUnavailable, fill_up, free_space, small_tmpfs

pytestmark = pytest.mark.faults

HOLD_S = float(os.environ.get("DELAYMQ_DISK_FULL_HOLD_S", "5"))
ROOM = 1 << 20  # what the filler leaves free in the data tmpfs: the load fills it
CONSUME_ROOM = 8 << 10  # ... and in the consume-log tmpfs
BODY = b"x" * 900
PRODUCERS = 4


@dataclass
class Disk:
    """The data folder, and the tmpfs whose filler is filled and freed."""

    data: Path
    full_part: Path  # the tmpfs that fills
    filler: Path
    room: int


@pytest.fixture
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Disk]:
    where = request.param
    with ExitStack() as stack:
        try:
            root = stack.enter_context(small_tmpfs(tmp_path / "disk", size="8m"))
            data = root / "data"
            if where == "consume":
                consume = stack.enter_context(small_tmpfs(data / "consume", size="1m"))
                yield Disk(data, consume, consume / "filler", CONSUME_ROOM)
            else:
                yield Disk(data, root, root / "filler", ROOM)
        except TmpfsUnavailable as error:
            pytest.skip(str(error))


@dataclass
class Tally:
    acknowledged: set[str] = field(default_factory=set)
    received: Counter[str] = field(default_factory=Counter)
    last_received_at: float = 0.0
    refused: int = 0  # SENDs answered unavailable
    other_errors: Counter[str] = field(default_factory=Counter)
    full_at: float | None = None
    freed_at: float | None = None


async def call(peers: Peers, address: str, command: int, metadata: dict[str, Any], body: bytes = b"") -> Any:
    return await peers.call(address, command, metadata, body, timeout=30)


@pytest.mark.parametrize(
    ("disk", "subjects", "batch_size", "most_batches"),
    [
        ("all", 1, 20, None),
        ("all", 32, 1, None),
        ("consume", 32, 1, 200),  # ~800 KiB of messages: the data tmpfs keeps room
    ],
    ids=["all-one-subject", "all-many-subjects", "consume-logs"],
    indirect=["disk"],
)
async def test_a_full_disk_then_every_acknowledged_message_is_delivered_without_restart(
    disk: Disk,
    tmp_path: Path,
    fault_report: Any,
    server_processes: SimpleNamespace,
    subjects: int,
    batch_size: int,
    most_batches: int | None,
) -> None:
    log_file = tmp_path / "server.log"
    tally = Tally()
    consumers = [{"group": "g", "consumer": "c", "subject": f"orders-{n}"} for n in range(subjects)]
    missing_found = ""
    with trio.fail_after(HOLD_S + 180):
        async with (
            open_peers() as peers,
            server_processes.realtime(disk.data, log_file=log_file, ack_timeout_ms=5000) as (address, process),
        ):
            for consumer in consumers:  # join
                await call(peers, address, Command.PULL, {**consumer, "max": 1, "timeout_ms": 0})
            fill_up(disk.filler)
            os.truncate(disk.filler, max(0, os.path.getsize(disk.filler) - disk.room))  # leave room for the load
            stop_sending = trio.Event()
            producing = PRODUCERS  # producers still holding a batch

            async def produce(number: int) -> None:
                nonlocal producing
                batch = 0
                while not stop_sending.is_set() and batch != most_batches:
                    messages = [
                        Message(
                            f"p{number}-{batch}-{i}", f"orders-{(batch * PRODUCERS + number + i) % subjects}", body=BODY
                        )
                        for i in range(batch_size)
                    ]
                    batch += 1
                    while True:  # the same batch until it is stored
                        try:
                            frame = await call(peers, address, Command.SEND, {}, encode_batch(messages))
                        except PeerError as error:
                            assert error.code == "unavailable", error
                            tally.refused += 1
                            await trio.sleep(0.05)
                            continue
                        assert frame.metadata["results"] == ["stored"] * batch_size  # never a false "duplicate"
                        tally.acknowledged.update(m.id for m in messages)
                        break
                    await trio.sleep(0.002)
                producing -= 1

            async def consume(consumer: dict[str, str]) -> None:
                while True:
                    try:
                        frame = await call(peers, address, Command.PULL, {**consumer, "max": 200, "timeout_ms": 500})
                    except PeerError as error:  # a pull log that could not be written: pulled again later
                        tally.other_errors[f"PULL {error.code}"] += 1
                        await trio.sleep(0.05)
                        continue
                    meta = frame.metadata
                    if meta["count"]:
                        tally.received.update(m.id for m in decode_batch(frame.body))
                        tally.last_received_at = time.monotonic()
                        ack = {**consumer, "start": meta["pull_start"], "end": meta["pull_start"] + meta["count"]}
                        while True:
                            try:
                                await call(peers, address, Command.ACK, ack)
                                break
                            except PeerError as error:  # applied in memory; answered once durable
                                tally.other_errors[f"ACK {error.code}"] += 1
                                await trio.sleep(0.2)
                    if not producing and tally.acknowledged <= set(tally.received):
                        return

            async def outage() -> None:
                while free_space(disk.full_part) >= 4096 and not tally.refused:
                    await trio.sleep(0.01)
                tally.full_at = time.monotonic()
                await trio.sleep(HOLD_S)
                assert free_space(disk.full_part) < disk.room  # still full: nothing gave up and freed it
                # Producers finish the batches they hold (retried until stored), start no
                # new ones: the load would fill the freed space again.
                stop_sending.set()
                disk.filler.unlink()
                tally.freed_at = time.monotonic()

            with trio.move_on_after(HOLD_S + 120) as deadline:
                async with trio.open_nursery() as nursery:
                    for number in range(PRODUCERS):
                        nursery.start_soon(produce, number)
                    for consumer in consumers:
                        nursery.start_soon(consume, consumer)
                    nursery.start_soon(outage)
            if deadline.cancelled_caught:  # which consume logs hold the missing ones
                missing = tally.acknowledged - set(tally.received)
                for consumer in consumers:
                    audit = {**consumer, "group": "audit", "max": 10_000, "timeout_ms": 0, "from": "earliest"}
                    frame = await call(peers, address, Command.PULL, audit)
                    held = {m.id for m in decode_batch(frame.body)} if frame.body else set()
                    if held & missing:
                        missing_found += f" {consumer['subject']}: {sorted(held & missing)} of {len(held)};"
            assert process.returncode is None  # the same process throughout
            for consumer in consumers:
                status = await call(peers, address, Command.PULL, {**consumer, "max": 1, "timeout_ms": 0})
                assert status.metadata["count"] == 0  # nothing more to come

    log_lines = log_file.read_text(errors="replace").splitlines()
    assert not deadline.cancelled_caught, (
        f"stuck: {len(tally.acknowledged)} acknowledged, {len(set(tally.received))} received, "
        f"{len(tally.acknowledged - set(tally.received))} missing, freed={tally.freed_at is not None}, "
        f"refused={tally.refused}, errors={dict(tally.other_errors)}; in consume logs:{missing_found or ' none'}\n"
        + "\n".join(line for line in log_lines if "refused SEND" not in line)
    )
    warnings = [line for line in log_lines if line.startswith(("WARNING", "ERROR", "CRITICAL"))]
    tracebacks = sum(line.startswith("Traceback") for line in log_lines)
    index_stalls = sum("indexing stopped" in line for line in log_lines)
    lost = len(tally.acknowledged - set(tally.received))
    duplicated = sum(count - 1 for count in tally.received.values() if count > 1)
    assert tally.full_at is not None and tally.freed_at is not None
    fault_report.record(
        acknowledged=len(tally.acknowledged),
        lost=lost,
        duplicated=duplicated,
        refused_sends=tally.refused,
        full_s=round(tally.freed_at - tally.full_at, 1),
        stall_ms=round(max(0.0, tally.last_received_at - tally.freed_at) * 1000),  # freed to last delivered
        index_stalls=index_stalls,
        warnings=len(warnings),
        tracebacks=tracebacks,
        restarts=0,
        other_errors=" ".join(f"{k}:{v}" for k, v in sorted(tally.other_errors.items())) or "-",
    )
    assert lost == 0 and duplicated == 0
    assert set(tally.received) <= tally.acknowledged  # nothing delivered that no send was told was stored
    if disk.full_part == disk.data.parent:
        assert tally.refused > 0  # the disk did fill under the load, and SENDs were refused
    else:
        assert tally.refused == 0 and index_stalls == 1  # stored, then held back by the index step only
    assert tracebacks == 0, "\n".join(log_lines[-60:])
    assert len(warnings) <= 3, "\n".join(warnings)  # one per part (message log, index, checkpoint), not per batch
