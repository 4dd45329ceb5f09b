"""Benchmarks against a real local cluster: ``delaymq bench realtime`` and ``delay``.

The cluster runs in a child process (``delaymq cluster``), so its peak RSS is
its own; one producer and one consumer run here, in one trio program. Figures
are printed, never asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import trio

from delaymq.client import open_consumer, open_producer
from delaymq.protocol.commands import Command
from delaymq.protocol.transport import open_peers

Row = tuple[str, float, str]
BODY = b"x" * 100
#: Batches one producer keeps in flight: a pipelined client, as a real one would be.
IN_FLIGHT = 4


@dataclass
class ClusterProcess:
    process: subprocess.Popen[str]
    meta: str
    scheduler: str | None

    def peak_rss_mb(self) -> float:
        """The child's high-water resident set (VmHWM), in MiB."""
        return _status_kb(self.process.pid, "VmHWM") / 1024

    def rss_mb(self) -> float:
        return _status_kb(self.process.pid, "VmRSS") / 1024


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@contextmanager
def local_cluster(
    data: Path, *, flush: str, env: Mapping[str, str] | None = None, stderr: IO[Any] | None = None
) -> Iterator[ClusterProcess]:
    """``delaymq cluster`` in a child process on a free port; stopped at the end.

    ``env`` replaces the child's environment, ``stderr`` (a file) takes its log.
    """
    process = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "delaymq.cli",
            "--log-level",
            "warning",
            "cluster",
            "--data",
            str(data),
            "--meta-listen",
            "127.0.0.1:0",
            "--flush",
            flush,
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        text=True,
    )
    try:
        assert process.stdout is not None
        addresses: dict[str, str] = {}
        for line in process.stdout:
            match = re.match(r"(metaserver|scheduler)\s+(\S+)", line)
            if match:
                addresses[match[1]] = match[2]
            if line.startswith("Ctrl-C"):
                break
        if "metaserver" not in addresses:
            raise RuntimeError(f"the cluster did not start (exit status {process.wait()})")
        yield ClusterProcess(process, addresses["metaserver"], addresses.get("scheduler"))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max of ``values`` (zeros when empty)."""
    if not values:
        return 0.0, 0.0, 0.0
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered), p99, ordered[-1]


async def _produce_and_consume(
    meta: str, subject: str, count: int, batch: int, delay_range: tuple[float, float] | None
) -> tuple[float, list[float], int, int]:
    """Send ``count`` messages in batches while one consumer takes them all.

    Returns (accepted msg/s, latencies in ms, lost, duplicated). Latency is
    receive time minus due time (``deliver_at``), or minus creation time for
    immediate messages.
    """
    received: dict[str, int] = {}
    latencies: list[float] = []
    duplicates = 0
    all_in = trio.Event()
    sent_ids: set[str] = set()
    async with open_consumer(
        meta, subject, group="bench", start="earliest", max_messages_held=20_000, pull_batch=1000
    ) as consumer:
        async with open_producer(meta) as producer:

            async def consume() -> None:
                nonlocal duplicates
                async for message in consumer:
                    due = message.deliver_at or message.created_at
                    latencies.append(message.received_at - due)
                    if message.id in received:
                        duplicates += 1
                    received[message.id] = 1
                    await message.ack()
                    if len(received) >= count:
                        all_in.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                start = time.perf_counter()
                rng = random.Random(7)
                window = trio.Semaphore(IN_FLIGHT)

                async def send(messages: list) -> None:
                    try:
                        sent_ids.update(await producer.send_batch(messages))
                    finally:
                        window.release()

                async with trio.open_nursery() as senders:
                    for first in range(0, count, batch):
                        n = min(batch, count - first)
                        if delay_range is None:
                            messages = [producer.message(subject, BODY) for _ in range(n)]
                        else:
                            messages = [
                                producer.message(subject, BODY, delay=rng.uniform(*delay_range)) for _ in range(n)
                            ]
                        await window.acquire()
                        senders.start_soon(send, messages)
                accepted = count / (time.perf_counter() - start)
                quiet_for = (delay_range[1] if delay_range else 0) + 30
                with trio.move_on_after(quiet_for):
                    await all_in.wait()
                nursery.cancel_scope.cancel()
    lost = len(sent_ids - received.keys())
    return accepted, latencies, lost, duplicates


def delivery_rows(
    case: str,
    what: str,
    accepted: float,
    delays: list[float],
    lost: int,
    duplicated: int,
    cluster: ClusterProcess,
) -> list[Row]:
    """The figures of one produce-and-consume run; ``delays`` are receive minus due, in ms."""
    p50, p99, worst = percentiles(delays)
    return [
        (f"{case}: accepted", accepted, "msg/s"),
        (f"{case}: {what} p50", p50, "ms"),
        (f"{case}: {what} p99", p99, "ms"),
        (f"{case}: {what} max", worst, "ms"),
        (f"{case}: delivered early", sum(1 for delay in delays if delay < 0), "msgs"),
        (f"{case}: lost", lost, "msgs"),
        (f"{case}: duplicated", duplicated, "msgs"),
        (f"{case}: server peak RSS", cluster.peak_rss_mb(), "MiB"),
    ]


def bench_realtime(scratch: Path, *, count: int = 100_000) -> list[Row]:
    """One producer (``IN_FLIGHT`` batches in flight), one consumer, 100-byte messages
    in batches of 100 and 1,000."""
    rows: list[Row] = []
    for flush in ("sync", "async"):
        for batch in (100, 1000):
            case = f"{flush} batch={batch}"
            with local_cluster(scratch / f"realtime-{flush}-{batch}", flush=flush) as cluster:
                accepted, latencies, lost, duplicated = trio.run(
                    _produce_and_consume, cluster.meta, "bench", count, batch, None
                )
                rows += delivery_rows(case, "end-to-end latency", accepted, latencies, lost, duplicated, cluster)
    return rows


async def _schedule_backlog(meta: str, scheduler: str, count: int, spread_ms: int) -> tuple[float, float]:
    """Schedule ``count`` messages uniformly over the next ``spread_ms``.

    Returns msg/s accepted and msg/s filed into the hourly schedule logs (until
    the scheduler's STATUS says every one is filed).
    """
    rng = random.Random(11)
    async with open_producer(meta) as producer:
        start = time.perf_counter()
        for first in range(0, count, 1000):
            n = min(1000, count - first)
            await producer.send_batch(
                [producer.message("backlog", BODY, delay=rng.uniform(60, spread_ms / 1000)) for _ in range(n)]
            )
        accepted = count / (time.perf_counter() - start)
    async with open_peers() as peers:
        while True:
            answer = await peers.call(scheduler, Command.STATUS, {})
            if answer.metadata["statistics"]["filed"] >= count:
                break
            await trio.sleep(0.2)  # polling a benchmark's progress, not synchronising a test
    return accepted, count / (time.perf_counter() - start)


def bench_delay(scratch: Path, *, count: int = 100_000, backlog: int = 1_000_000) -> list[Row]:
    """DESIGN.md section 7: messages due at now + uniform(2 s, 20 s), then a 30-day backlog."""
    rows: list[Row] = []
    for flush in ("sync", "async"):
        with local_cluster(scratch / f"delay-{flush}", flush=flush) as cluster:
            accepted, lateness, lost, duplicated = trio.run(
                _produce_and_consume, cluster.meta, "bench", count, 1000, (2.0, 20.0)
            )
            rows += delivery_rows(flush, "lateness", accepted, lateness, lost, duplicated, cluster)
    with local_cluster(scratch / "delay-backlog", flush="async") as cluster:
        before = cluster.rss_mb()
        assert cluster.scheduler is not None
        accepted, filed = trio.run(_schedule_backlog, cluster.meta, cluster.scheduler, backlog, 30 * 86_400_000)
        rows += [
            (f"{backlog:,} over 30 days: accepted", accepted, "msg/s"),
            (f"{backlog:,} over 30 days: filed into hours", filed, "msg/s"),
            ("server RSS before the backlog", before, "MiB"),
            (f"server RSS with {backlog:,} scheduled", cluster.rss_mb(), "MiB"),
            ("server peak RSS while scheduling", cluster.peak_rss_mb(), "MiB"),
        ]
    return rows


__all__ = ["bench_delay", "bench_realtime", "local_cluster", "percentiles"]
