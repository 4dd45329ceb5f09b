"""A realtime server process killed with SIGKILL keeps every acknowledged send and ack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from delaymq.protocol.records import Message
from delaymq.protocol.transport import open_peers
from delaymq.realtime.consumelog import ENTRY_SIZE, subject_stem

pytestmark = pytest.mark.slow

SERVER = """
import sys, trio
from delaymq.realtime import open_realtime_server
from delaymq.wheel.clock import SystemClock

async def main():
    async with open_realtime_server(
        data_dir=sys.argv[1], clock=SystemClock(), ack_timeout_ms=1000, checkpoint_interval_ms=600_000
    ) as server:
        print(server.address, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@asynccontextmanager
async def server_process(data_dir: Path) -> AsyncIterator[str]:
    """A server in a child process; yields its address (read from its first line)."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-P", "-c", SERVER, str(data_dir)], stdout=subprocess.PIPE, cwd=data_dir.parent
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1024)
                assert chunk, f"the server exited with {await process.wait()} before printing its address"
                line += chunk
        yield line.decode().strip()
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        await process.wait()


async def test_sigkill_and_restart_lose_no_acknowledged_send_or_ack(tmp_path: Path, rt: SimpleNamespace) -> None:
    data = tmp_path / "realtime"
    first = rt.messages(20, prefix="a")
    second = rt.messages(20, prefix="b")
    with trio.fail_after(60):
        async with open_peers() as peers:
            async with server_process(data) as address:
                producer = rt.peers_client(peers, address)
                c1 = rt.peers_client(peers, address, consumer="c1")
                assert await producer.send(first) == ["stored"] * 20
                taken = await c1.pull(10, **{"from": "earliest"})
                assert taken.ids == [m.id for m in first[:10]]
                assert await c1.ack(0, 5) == 5  # committed: positions, acks, index so far
                assert await producer.send(second) == ["stored"] * 20  # indexed, not checkpointed
            # SIGKILLed. The consume-log entries past the checkpoint may be torn or lost:
            # lose the last one and a half, and garble one before them.
            consume = data / "consume" / f"{subject_stem('orders')}.log"
            size = consume.stat().st_size
            assert size == 40 * ENTRY_SIZE
            os.truncate(consume, size - ENTRY_SIZE - ENTRY_SIZE // 2)
            with open(consume, "r+b") as file:
                file.seek(30 * ENTRY_SIZE + 3)
                file.write(b"\xff\xff")

            async with server_process(data) as address:
                producer = rt.peers_client(peers, address)
                everything = await rt.peers_client(peers, address, group="g2").pull(100, **{"from": "earliest"})
                assert everything.ids == [m.id for m in first + second]
                assert [m.body for m in everything.messages] == [m.body for m in first + second]
                assert await producer.send([first[0], second[-1], Message("new", "orders")]) == [
                    "duplicate",
                    "duplicate",
                    "stored",
                ]
                # The group resumes where it was; c1's unacked five come back after the
                # ack timeout (with attempts 1), its acked five never do.
                c2 = rt.peers_client(peers, address, consumer="c2")
                got: dict[str, int] = {}
                while len(got) < 15 + 20 + 1:
                    pulled = await c2.pull(100, timeout_ms=5000)
                    for message in pulled.messages:
                        assert message.id not in got, f"{message.id} delivered twice"
                        got[message.id] = message.attempts
                    if pulled.count:
                        await c2.ack(pulled.start, pulled.end)
                assert set(got) == {m.id for m in first[5:] + second} | {"new"}
                assert {got[m.id] for m in first[5:10]} == {1}
                assert {got[m.id] for m in first[10:] + second} == {0}
