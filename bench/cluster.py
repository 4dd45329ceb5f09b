"""Benchmarks against a real local cluster: ``delaymq bench realtime`` and ``delay``.

The cluster runs in a child process (``delaymq cluster``, itself one process per
server), so its peak RSS and CPU are its own; one producer and one consumer run
here, in one trio program. Figures are printed, never asserted: these machines are
shared and noisy.

``delay`` also says where the time and the CPU go (docs/performance.md): the
lateness of each stage of a delayed message (due -> fired by the scheduler ->
accepted by realtime -> handed to the consumer -> received), from the servers'
STATUS histograms and the consumer's clock; each server process's CPU seconds per
100,000 messages (``/proc/PID/stat`` before and after); dispatch batches and fire
rounds; fsyncs per second. Then the same workload against a Redis sorted-set
queue (``delaymq.bench.redis_queue``), and delaymq's figures as ratios to its.
"""

from __future__ import annotations

import glob
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

import trio

from delaymq.bench.redis_queue import (
    RedisProcess,
    RedisRun,
    accept_burst,
    bench_redis_delay,
    cpu_seconds,
    find_redis_server,
    redis_client_missing,
    redis_server,
)
from delaymq.client import Consumer, Message, Producer, open_consumer, open_producer
from delaymq.net.peers import open_peers
from delaymq.net.serving import tuned_collector
from delaymq.protocol.commands import Command
from delaymq.protocol.histogram import LatencyHistogram

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
        """The high-water resident sets (VmHWM) of the cluster's processes, added up, in MiB."""
        return sum(_status_kb(pid, "VmHWM") for pid in process_tree(self.process.pid)) / 1024

    def rss_mb(self) -> float:
        return sum(_status_kb(pid, "VmRSS") for pid in process_tree(self.process.pid)) / 1024


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except FileNotFoundError:  # exited meanwhile
        pass
    return 0


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, parents first (``/proc/PID/task/*/children``)."""
    pids = [root]
    for pid in pids:  # grows while walked
        for children in glob.glob(f"/proc/{pid}/task/*/children"):
            try:
                with open(children) as listed:
                    pids.extend(int(child) for child in listed.read().split())
            except FileNotFoundError:
                pass
    return pids


def _listening_ports() -> dict[int, int]:
    """Socket inode -> port of every TCP socket listening in this network namespace."""
    ports: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[3] == "0A":  # LISTEN
                        ports[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
        except FileNotFoundError:
            pass
    return ports


def server_processes(root: int, addresses: Mapping[str, str]) -> dict[str, int]:
    """Each process of the cluster named by the servers it runs: the ones whose listening
    socket it holds (``addresses``: server name -> HOST:PORT). One process running every
    server is one entry; a process serving none (a supervisor) is named as such."""
    ports = _listening_ports()
    pids = process_tree(root)
    holder: dict[int, int] = {}  # port -> pid; a child wins over the root (an inherited copy)
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                port = ports.get(int(target[8:-1]))
                if port is not None and (port not in holder or holder[port] == root):
                    holder[port] = pid
    names: dict[int, list[str]] = {pid: [] for pid in pids}
    for name, address in addresses.items():
        pid = holder.get(int(address.rsplit(":", 1)[1]), root)
        names.setdefault(pid, []).append(name)
    labelled: dict[str, int] = {}
    for pid, served in names.items():
        if served:
            labelled["+".join(sorted(served))] = pid
        elif pid == root:
            labelled["cluster supervisor"] = pid
        else:
            labelled[f"other process {pid}"] = pid
    return labelled


def _cpu_of(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each live process so far."""
    used: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            used[name] = cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return used


@contextmanager
def local_cluster(
    data: Path,
    *,
    flush: str,
    env: Mapping[str, str] | None = None,
    stderr: IO[Any] | None = None,
    scheduler_options: Sequence[str] = (),
) -> Iterator[ClusterProcess]:
    """``delaymq cluster`` in a child process on a free port; stopped at the end.

    ``env`` replaces the child's environment, ``stderr`` (a file) takes its log;
    ``scheduler_options`` go to ``delaymq cluster`` (``--send-interval``, ``--send-ahead``).
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
            *scheduler_options,
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
    async with _bench_consumer(meta, subject) as consumer:
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
                accepted = await _send_all(producer, subject, count, batch, delay_range, sent_ids)
                quiet_for = (delay_range[1] if delay_range else 0) + 30
                with trio.move_on_after(quiet_for):
                    await all_in.wait()
                nursery.cancel_scope.cancel()
    lost = len(sent_ids - received.keys())
    return accepted, latencies, lost, duplicates


def _bench_consumer(meta: str, subject: str) -> AbstractAsyncContextManager[Consumer]:
    """The delay runs' consumer: group ``bench`` from the earliest message, up to 20,000 held
    and 1,000 a pull (a full run receives with it; a burst keeps it connected, as a full run does)."""
    return open_consumer(meta, subject, group="bench", start="earliest", max_messages_held=20_000, pull_batch=1000)


async def _send_all(
    producer: Producer,
    subject: str,
    count: int,
    batch: int,
    delay_range: tuple[float, float] | None,
    sent_ids: set[str],
) -> float:
    """The producer's part: ``count`` messages in batches of ``batch``, ``IN_FLIGHT`` batches
    in flight, their ids into ``sent_ids``; returns the msg/s accepted."""
    start = time.perf_counter()
    rng = random.Random(7)
    window = trio.Semaphore(IN_FLIGHT)

    async def send(messages: list[Message]) -> None:
        try:
            sent_ids.update(await producer.send_batch(messages))
        finally:
            window.release()

    async with trio.open_nursery() as senders:
        for _first, messages in bench_batches(producer, subject, count, batch, delay_range, rng):
            await window.acquire()
            senders.start_soon(send, messages)
    return count / (time.perf_counter() - start)


def bench_batches(
    producer: Producer,
    subject: str,
    count: int,
    batch: int,
    delay_range: tuple[float, float] | None,
    rng: random.Random,
) -> Iterator[tuple[int, list[Message]]]:
    """``count`` messages of ``BODY`` in batches of ``batch``, each with the index of its first:
    due at now + uniform(``delay_range``) s, or now (None). Each batch is built when asked for."""
    for first in range(0, count, batch):
        n = min(batch, count - first)
        if delay_range is None:
            yield first, [producer.message(subject, BODY) for _ in range(n)]
        else:
            yield first, [producer.message(subject, BODY, delay=rng.uniform(*delay_range)) for _ in range(n)]


async def _accept_burst(meta: str, count: int, delay_range: tuple[float, float]) -> float:
    """The producer's part into a fresh cluster, its consumer connected as in the full run
    (nothing falls due during a burst): msg/s accepted."""
    async with (
        _bench_consumer(meta, "bench") as consumer,
        open_producer(meta) as producer,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_ack_all, consumer)
        with tuned_collector():
            accepted = await _send_all(producer, "bench", count, 1000, delay_range, set())
        nursery.cancel_scope.cancel()
    return accepted


async def _ack_all(consumer: Consumer) -> None:
    async for message in consumer:
        await message.ack()


def burst_rows(
    scratch: Path,
    *,
    count: int,
    delay_range: tuple[float, float],
    flushes: tuple[str, ...],
    bursts: int,
    redis: bool,
) -> list[Row]:
    """The accept rate alone, ``bursts`` times for each flush policy (a fresh cluster each) and
    for Redis, interleaved: one burst of ``count`` lasts well under a second and its rate moves
    by about a tenth from one run to the next, so the median of several says more than one run."""
    ours: dict[str, list[float]] = {flush: [] for flush in flushes}
    theirs: list[float] = []
    with ExitStack() as stack:
        server: RedisProcess | None = None
        if redis and redis_client_missing() is None:
            program, _why = find_redis_server(install=False)  # (installed by the full run if it could be)
            if program is not None:
                server = stack.enter_context(redis_server(program, scratch / "redis-bursts"))
        for number in range(bursts):
            for flush in flushes:
                with local_cluster(scratch / f"burst-{number}-{flush}", flush=flush) as cluster:
                    ours[flush].append(trio.run(_accept_burst, cluster.meta, count, delay_range))
            if server is not None:
                theirs.append(accept_burst(server, count=count, delay_range=delay_range))
    rows: list[Row] = []
    label = f"of {bursts} bursts"
    for name, rates in [*ours.items(), *([("Redis ZSET", theirs)] if theirs else [])]:
        rows += [
            (f"{name}: accepted, median {label}", statistics.median(rates), "msg/s"),
            (f"{name}: accepted, slowest {label}", min(rates), "msg/s"),
            (f"{name}: accepted, fastest {label}", max(rates), "msg/s"),
        ]
    if theirs:
        rows += [
            (
                f"{flush} / Redis: accepted, median {label}",
                _ratio(statistics.median(rates), statistics.median(theirs)),
                "%",
            )
            for flush, rates in ours.items()
        ]
    return rows


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
        for _first, messages in bench_batches(producer, "backlog", count, 1000, (60, spread_ms / 1000), rng):
            await producer.send_batch(messages)
        accepted = count / (time.perf_counter() - start)
    async with open_peers() as peers:
        while True:
            answer = await peers.call(scheduler, Command.STATUS, {})
            if answer.metadata["statistics"]["filed"] >= count:
                break
            await trio.sleep(0.2)  # polling a benchmark's progress, not synchronising a test
    return accepted, count / (time.perf_counter() - start)


#: The stages a delayed message passes after it is due, each with the server whose STATUS
#: holds its lateness histogram and the field; the last stage is measured here.
STAGES = (
    ("fired by the scheduler", "scheduler", "lateness_fired"),
    ("accepted by realtime", "realtime", "lateness_accepted"),
    ("handed to the consumer", "realtime", "lateness_handed_out"),
)
RECEIVED = "received by the consumer"
#: The scheduler's options of the comparison case: each message fired at its moment, one SEND
#: per round trip (the shape before ``--send-ahead``).
AT_THE_MOMENT = ("--send-ahead", "0ms", "--send-interval", "0ms")
#: STATUS counters a delay run reads before and after (server kind -> fields).
COUNTERS = {
    "scheduler": ("dispatched", "dispatch_batches", "fire_rounds", "confirm_rounds", "message_log_fsyncs", "filing_fsyncs"),
    "realtime": ("message_log_fsyncs", "checkpoints", "sends", "pulls", "acks"),
}  # fmt: skip


@dataclass
class DelayRun:
    """What one run of the delay workload against the cluster measured."""

    accepted: float  # msg/s
    lateness_ms: list[float]  # received - due, per message received
    lost: int
    duplicated: int
    seconds: float  # first send to last message received
    stages: dict[str, LatencyHistogram]  # stage -> lateness in ms, in order, "received" last
    cpu_seconds: dict[str, float]  # process (named by the servers it runs) -> CPU seconds over the run
    counters: dict[str, int]  # "kind.field" -> growth over the run


async def _server_addresses(meta: str) -> dict[str, str]:
    """Server name -> address: the metaserver, and the scheduler and realtime server it knows."""
    async with open_peers() as peers:
        with trio.fail_after(30):
            while True:
                answer = await peers.call(meta, Command.STATUS, {})
                found = {"metaserver": meta}
                for row in answer.metadata.get("rows") or []:
                    if row.get("kind") in COUNTERS and not row.get("evicted"):
                        found.setdefault(row["kind"], row["address"])
                if len(found) == 1 + len(COUNTERS):
                    return found
                await trio.sleep(0.1)  # polling a cluster's start-up, not synchronising a test


async def _statistics(addresses: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each server's STATUS statistics (kind -> map)."""
    answers: dict[str, dict[str, Any]] = {}
    async with open_peers() as peers:
        for kind in COUNTERS:
            metadata = {"hours": 1} if kind == "scheduler" else {}
            answers[kind] = (await peers.call(addresses[kind], Command.STATUS, metadata)).metadata["statistics"]
    return answers


async def _delay_run(cluster: ClusterProcess, count: int, delay_range: tuple[float, float]) -> DelayRun:
    addresses = await _server_addresses(cluster.meta)
    processes = server_processes(cluster.process.pid, addresses)
    before = await _statistics(addresses)
    cpu_before = _cpu_of(processes)
    with tuned_collector():
        started = time.perf_counter()
        accepted, lateness, lost, duplicated = await _produce_and_consume(
            cluster.meta, "bench", count, 1000, delay_range
        )
    seconds = time.perf_counter() - started
    cpu_after = _cpu_of(processes)
    after = await _statistics(addresses)
    stages = {label: LatencyHistogram.from_wire(after[kind][field]) for label, kind, field in STAGES}
    received = stages[RECEIVED] = LatencyHistogram()
    received.record_many([round(value) for value in lateness])
    return DelayRun(
        accepted=accepted,
        lateness_ms=lateness,
        lost=lost,
        duplicated=duplicated,
        seconds=seconds,
        stages=stages,
        cpu_seconds={name: cpu_after[name] - cpu_before[name] for name in cpu_before if name in cpu_after},
        counters={
            f"{kind}.{field}": after[kind].get(field, 0) - before[kind].get(field, 0)
            for kind, fields in COUNTERS.items()
            for field in fields
        },
    )


def _ratio(ours: float, theirs: float) -> float:
    return 100 * ours / theirs if theirs else float("nan")


def stage_rows(case: str, run: DelayRun) -> list[Row]:
    """How many messages passed each stage (redeliveries count again) and p50/p99/max of their
    lateness there (due -> that stage), in ms."""
    rows: list[Row] = []
    for label, histogram in run.stages.items():
        p50, p99, worst = histogram.summary()
        rows += [
            (f"{case}: due -> {label}, messages", histogram.count, "msgs"),
            (f"{case}: due -> {label} p50", p50, "ms"),
            (f"{case}: due -> {label} p99", p99, "ms"),
            (f"{case}: due -> {label} max", worst, "ms"),
        ]
    return rows


def cost_rows(case: str, run: DelayRun, count: int) -> list[Row]:
    """CPU per server process, dispatch batching and fsyncs of one delay run."""
    per_100k = 100_000 / count
    total = sum(run.cpu_seconds.values())
    rows: list[Row] = [
        (f"{case}: CPU per 100,000 msgs, {name}", seconds * per_100k, "s") for name, seconds in run.cpu_seconds.items()
    ]
    counters = run.counters
    batches = counters["scheduler.dispatch_batches"]
    rounds = counters["scheduler.fire_rounds"]
    dispatched = counters["scheduler.dispatched"]
    fsyncs = {
        "scheduler message log": counters["scheduler.message_log_fsyncs"],
        "scheduler filing (schedule logs)": counters["scheduler.filing_fsyncs"],
        "scheduler dispatch-log rounds": counters["scheduler.confirm_rounds"],
        "realtime message log": counters["realtime.message_log_fsyncs"],
        "realtime checkpoints": counters["realtime.checkpoints"],
    }
    rows += [
        (f"{case}: CPU per 100,000 msgs, all server processes", total * per_100k, "s"),
        (f"{case}: server CPU per message", total / count * 1e6, "us"),
        (f"{case}: dispatch batches (SENDs to realtime)", batches, "batches"),
        (f"{case}: dispatch batch mean size", dispatched / batches if batches else 0.0, "msgs"),
        (f"{case}: fire rounds", rounds, "rounds"),
        (f"{case}: fire round mean size", dispatched / rounds if rounds else 0.0, "msgs"),
        (f"{case}: PULLs answered by realtime", counters["realtime.pulls"], "requests"),
        (f"{case}: ACKs answered by realtime", counters["realtime.acks"], "requests"),
        *((f"{case}: fsyncs/s, {name}", value / run.seconds, "/s") for name, value in fsyncs.items()),
        (f"{case}: fsyncs/s, all of the above", sum(fsyncs.values()) / run.seconds, "/s"),
    ]
    return rows


def redis_rows(run: RedisRun, count: int) -> list[Row]:
    p50, p99, worst = percentiles(run.lateness_ms)
    return [
        ("Redis ZSET: accepted", run.accepted, "msg/s"),
        ("Redis ZSET: lateness p50", p50, "ms"),
        ("Redis ZSET: lateness p99", p99, "ms"),
        ("Redis ZSET: lateness max", worst, "ms"),
        ("Redis ZSET: delivered early", sum(1 for delay in run.lateness_ms if delay < 0), "msgs"),
        ("Redis ZSET: lost", run.lost, "msgs"),
        ("Redis ZSET: duplicated", run.duplicated, "msgs"),
        ("Redis ZSET: redis-server CPU per 100,000 msgs", run.cpu_seconds * 100_000 / count, "s"),
        ("Redis ZSET: redis-server peak RSS", run.peak_rss_mb, "MiB"),
    ]


def ratio_rows(case: str, run: DelayRun, redis: RedisRun) -> list[Row]:
    """delaymq's figures as a percentage of Redis's (accepted: higher is better; the rest: lower)."""
    ours = percentiles(run.lateness_ms)
    theirs = percentiles(redis.lateness_ms)
    return [
        (f"{case} / Redis: accepted", _ratio(run.accepted, redis.accepted), "%"),
        (f"{case} / Redis: lateness p50", _ratio(ours[0], theirs[0]), "%"),
        (f"{case} / Redis: lateness p99", _ratio(ours[1], theirs[1]), "%"),
        (f"{case} / Redis: lateness max", _ratio(ours[2], theirs[2]), "%"),
        (f"{case} / Redis: server CPU", _ratio(sum(run.cpu_seconds.values()), redis.cpu_seconds), "%"),
    ]


def bench_delay(
    scratch: Path,
    *,
    count: int = 100_000,
    backlog: int = 1_000_000,
    delay_range: tuple[float, float] = (2.0, 20.0),
    flushes: tuple[str, ...] = ("sync", "async"),
    at_the_moment: bool = True,
    redis: bool = True,
    install_redis: bool = True,
    bursts: int = 5,
) -> list[Row]:
    """The delay workload (docs/performance.md, "The delay workload"): messages due at now + uniform(2 s, 20 s) under each flush policy
    (the cluster's defaults: sent 100 ms ahead, SENDs 60 ms apart), where their lateness and the
    servers' CPU go; with ``at_the_moment`` the first policy once more with each message fired
    at its moment (``--send-ahead 0ms --send-interval 0ms``: the shape before sending ahead,
    for comparison); the same workload on a Redis sorted set (``redis``; ``install_redis``:
    apt-get install redis-server when missing, as root); the accept rate alone in ``bursts``
    bursts each (``burst_rows``: medians); and then a 30-day backlog (none when ``backlog`` is 0)."""
    rows: list[Row] = []
    runs: dict[str, DelayRun] = {}
    cases: list[tuple[str, str, tuple[str, ...]]] = [(flush, flush, ()) for flush in flushes]
    if at_the_moment and flushes:
        cases.append((f"{flushes[0]} at the moment", flushes[0], AT_THE_MOMENT))
    for number, (case, flush, options) in enumerate(cases):
        folder = scratch / f"delay-{number}-{flush}"
        with local_cluster(folder, flush=flush, scheduler_options=options) as cluster:
            run = runs[case] = trio.run(partial(_delay_run, cluster, count, delay_range))
            rows += delivery_rows(case, "lateness", run.accepted, run.lateness_ms, run.lost, run.duplicated, cluster)
            rows += stage_rows(case, run)
            rows += cost_rows(case, run, count)
    if redis:
        redis_run, why = bench_redis_delay(
            scratch / "redis", count=count, delay_range=delay_range, install=install_redis
        )
        redis = redis_run is not None  # the bursts compare with Redis only where the full run could
        if redis_run is None:
            print(f"delaymq bench delay: the Redis comparison is skipped: {why}", flush=True)
        else:
            rows += redis_rows(redis_run, count)
            for case, run in runs.items():
                rows += ratio_rows(case, run, redis_run)
    if bursts and flushes:
        rows += burst_rows(
            scratch, count=count, delay_range=delay_range, flushes=flushes, bursts=bursts, redis=redis,
        )  # fmt: skip
    if backlog:
        rows += backlog_rows(scratch, backlog)
    return rows


def backlog_rows(scratch: Path, backlog: int) -> list[Row]:
    """``backlog`` messages scheduled over 30 days: accept and filing rates, memory."""
    with local_cluster(scratch / "delay-backlog", flush="async") as cluster:
        before = cluster.rss_mb()
        assert cluster.scheduler is not None
        accepted, filed = trio.run(_schedule_backlog, cluster.meta, cluster.scheduler, backlog, 30 * 86_400_000)
        return [
            (f"{backlog:,} over 30 days: accepted", accepted, "msg/s"),
            (f"{backlog:,} over 30 days: filed into hours", filed, "msg/s"),
            ("server RSS before the backlog", before, "MiB"),
            (f"server RSS with {backlog:,} scheduled", cluster.rss_mb(), "MiB"),
            ("server peak RSS while scheduling", cluster.peak_rss_mb(), "MiB"),
        ]


__all__ = [
    "STAGES",
    "DelayRun",
    "bench_delay",
    "bench_realtime",
    "local_cluster",
    "percentiles",
    "process_tree",
    "server_processes",
]
