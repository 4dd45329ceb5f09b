"""A realtime server SIGKILLed under load: nothing lost, and what comes again says so.

The server runs in a child process registered with a metaserver (here, in the
test process); a real ``Producer`` and ``Consumer`` work through it while it is
killed with SIGKILL and restarted on the same address, again and again. Every
acknowledged message must arrive; a message that arrives a second time must
carry ``attempts >= 1`` (the consumer can tell it may have seen it before).

A second test damages the message log of a killed server below its index
checkpoint (its last segment cut in the middle) and checks that the restarted
process serves every message before the damage and says what it lost.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from delaymq.client import open_consumer, open_producer
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.records import Message, decode_batch, encode_batch

pytestmark = pytest.mark.faults

KILLS = int(os.environ.get("DELAYMQ_REALTIME_KILLS", "4"))
MESSAGES = 14_020
BATCH = 20

#: The child server's options (``open_realtime_server``).
SERVER_OPTIONS = {"ack_timeout_ms": 3000}


async def test_sigkill_under_load_loses_nothing_and_marks_every_message_handed_out_again(
    tmp_path: Path, fault_report: Any, server_processes: SimpleNamespace
) -> None:
    data, log_file = tmp_path / "realtime", tmp_path / "server.log"
    deliveries: defaultdict[str, list[int]] = defaultdict(list)  # id -> attempts of each delivery
    acknowledged: set[str] = set()
    restarts_ms: list[float] = []
    missing: set[str] = set()  # acknowledged, not yet delivered
    produced = trio.Event()
    all_in = trio.Event()

    def check_all_in() -> None:
        if produced.is_set() and not missing:
            all_in.set()

    with trio.fail_after(300):
        async with open_metaserver(data_dir=tmp_path / "meta", clock=SystemClock()) as meta:
            async with server_processes.realtime(
                data, log_file=log_file, meta_address=meta.address, **SERVER_OPTIONS
            ) as (address, process):
                current = [process]

                async def produce() -> None:
                    async with open_producer(meta.address) as producer:
                        for first in range(0, MESSAGES, BATCH):
                            batch = [
                                producer.message("orders", f"body {i}")
                                for i in range(first, min(MESSAGES, first + BATCH))
                            ]
                            while True:  # the same batch (same ids) until it is stored
                                try:
                                    ids = await producer.send_batch(batch)
                                except Exception:
                                    await trio.sleep(0.05)  # a backoff, not a synchronisation
                                    continue
                                acknowledged.update(ids)
                                missing.update(i for i in ids if i not in deliveries)
                                break
                            await trio.sleep(0.002)  # spread the load over the kills
                    produced.set()
                    check_all_in()

                async def consume() -> None:
                    async with open_consumer(
                        meta.address, "orders", group="g", start="earliest", poll_timeout=1.0, request_timeout=3.0
                    ) as consumer:
                        async for message in consumer:
                            deliveries[message.id].append(message.attempts)
                            missing.discard(message.id)
                            await message.ack()
                            check_all_in()

                async def kill_and_restart(nursery: trio.Nursery) -> None:
                    for _ in range(KILLS):
                        await trio.sleep(1.5)
                        current[0].send_signal(signal.SIGKILL)
                        await current[0].wait()
                        killed_at = time.monotonic()

                        async def run_again(
                            killed_at: float = killed_at, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                        ) -> None:
                            async with server_processes.realtime(
                                data, log_file=log_file, listen=address, meta_address=meta.address, **SERVER_OPTIONS
                            ) as (_address, again):
                                current[0] = again
                                restarts_ms.append((time.monotonic() - killed_at) * 1000)
                                task_status.started()
                                await again.wait()  # until the next kill

                        await nursery.start(run_again)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consume)
                    nursery.start_soon(produce)
                    await kill_and_restart(nursery)
                    with trio.move_on_after(120):
                        await all_in.wait()
                    nursery.cancel_scope.cancel()
    lost = acknowledged - deliveries.keys()
    again = {message_id: attempts for message_id, attempts in deliveries.items() if len(attempts) > 1}
    unmarked = sum(1 for attempts in again.values() for later in attempts[1:] if later == 0)
    fault_report.record(
        sent=len(acknowledged),
        kills=KILLS,
        lost=len(lost),
        duplicated=len(again),
        duplicated_unmarked=unmarked,
        first_deliveries_marked=sum(1 for attempts in deliveries.values() if attempts[0] > 0),
        max_restart_ms=round(max(restarts_ms, default=0)),
    )
    assert len(acknowledged) == MESSAGES
    assert not lost, f"{len(lost)} acknowledged messages never arrived, e.g. {sorted(lost)[:5]}"
    assert unmarked == 0, f"handed out again with attempts 0: { {k: v for k, v in again.items() if 0 in v[1:]} }"


async def test_a_killed_server_whose_message_log_is_cut_below_its_checkpoint_starts_and_serves_the_rest(
    tmp_path: Path, fault_report: Any, server_processes: SimpleNamespace
) -> None:
    data, log_file = tmp_path / "realtime", tmp_path / "server.log"
    consumer = {"subject": "orders", "max": 1000, "timeout_ms": 0}
    sent = [Message(f"m{i:05d}", "orders", body=b"x" * 200) for i in range(2000)]
    with trio.fail_after(120):
        async with open_peers() as peers:
            async with server_processes.realtime(data, log_file=log_file, **SERVER_OPTIONS) as (address, process):
                for first in range(0, len(sent), 100):
                    frame = await peers.call(
                        address, Command.SEND, {}, encode_batch(sent[first : first + 100]), timeout=30
                    )
                    assert frame.metadata["results"] == ["stored"] * 100
                # An ack waits for a checkpoint: the index checkpoint covers every send.
                taken = await peers.call(
                    address,
                    Command.PULL,
                    {**consumer, "group": "old", "consumer": "o", "from": "earliest", "max": 500},
                    b"",
                )
                assert taken.metadata["count"] == 500
                await peers.call(
                    address,
                    Command.ACK,
                    {"subject": "orders", "group": "old", "consumer": "o", "start": 0, "end": 500},
                    b"",
                )
                process.send_signal(signal.SIGKILL)
            (segment,) = [p for p in (data / "messages").iterdir() if p.name.isdigit()]
            size = segment.stat().st_size
            assert size % len(sent) == 0  # records of one size
            os.truncate(segment, size // 2)
            intact = sent[: size // 2 // (size // len(sent))]
            started = time.monotonic()
            async with server_processes.realtime(data, log_file=log_file, **SERVER_OPTIONS) as (address, process):
                restart_ms = (time.monotonic() - started) * 1000
                got: list[Message] = []
                while True:
                    frame = await peers.call(
                        address,
                        Command.PULL,
                        {**consumer, "group": "fresh", "consumer": "f", "from": "earliest"},
                        b"",
                        timeout=30,
                    )
                    if not frame.metadata["count"]:
                        break
                    got.extend(decode_batch(frame.body))
                resumed = await peers.call(
                    address, Command.PULL, {**consumer, "group": "old", "consumer": "o"}, b"", timeout=30
                )
                frame = await peers.call(
                    address, Command.SEND, {}, encode_batch([Message("after", "orders")]), timeout=30
                )
                assert frame.metadata["results"] == ["stored"]
    assert [(m.id, m.body) for m in got] == [(m.id, m.body) for m in intact]
    assert [m.id for m in decode_batch(resumed.body)] == [m.id for m in intact[500:]]
    warnings = [line for line in log_file.read_text().splitlines() if line.startswith("WARNING delaymq.realtime")]
    assert len(warnings) == 1 and f" bytes, {len(sent) - len(got)} record(s))" in warnings[0], warnings
    fault_report.record(lost=len(sent) - len(got), delivered_before_damage=len(got), restart_ms=round(restart_ms))
