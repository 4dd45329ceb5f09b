"""``delaymq bench cancel``: how fast a scheduler cancels and looks up scheduled messages,
and what its id index costs, at 1 and 10 million scheduled.

For each count the benchmark builds a scheduler data folder holding that many
messages of 100 bytes due over the next 30 days, each with a business key that names
two of them (written and filed with the scheduler's own code, which also fills its
id and key index, as ``bench restart`` does), then runs a metaserver, a realtime
server and that scheduler as ``delaymq`` processes. It prints:

- the lmdb state's named databases (entries and bytes on disk) and the state file's
  size, so the index's cost per message can be read off;
- the scheduler's resident memory after start and after the runs (anonymous: the
  heap; file: lmdb pages mapped in);
- QUERY and CANCEL rates from a producer: single ids (``CONCURRENCY`` requests in
  flight), batches of ``BATCH`` ids (ids per second) and CANCEL by key.

``DELAYMQ_BENCH_CANCEL_COUNTS`` (comma separated, e.g. ``20000``) replaces the counts
for a quick run. Figures are printed, never asserted.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio

from delaymq.bench.restart import Servers, build_backlog, running_servers, wait_delivering, wait_serving
from delaymq.client import open_producer
from delaymq.client.producer import Producer
from delaymq.client.routes import NoRouteError

Row = tuple[str, float, str]
BODY = b"x" * 100
SPREAD_MS = 30 * 86_400_000
DEFAULT_COUNTS = (1_000_000, 10_000_000)
#: Ids per batched request, and requests in flight for single-id requests.
BATCH = 100
CONCURRENCY = 16
_BUILD_BATCH = 10_000


def message_id(n: int) -> str:
    return f"bench-{n:010d}"


def business_key(n: int) -> str:
    return f"order-{n // 2}"


def build_keyed_backlog(data: Path, count: int, *, now_ms: int) -> float:
    """A scheduler data folder holding ``count`` keyed messages, every one filed (and indexed);
    returns the seconds it took."""
    return build_backlog(
        data, count, now_ms=now_ms, first_due_ms=600_000, message_id=message_id, key=business_key, seed=14
    )


def lmdb_rows(state: Path, label: str) -> list[Row]:
    """Entries and bytes of every named database of the lmdb state, and the file's size on disk."""
    import lmdb

    rows: list[Row] = []
    env = lmdb.open(str(state), readonly=True, lock=False, max_dbs=256, subdir=True)
    try:
        with env.begin() as txn:
            names = [bytes(key) for key, _ in txn.cursor()]
        for name in names:
            try:
                db = env.open_db(name, create=False)
            except lmdb.Error:
                continue  # a plain key of the main database, not a named one
            with env.begin() as txn:
                stat = txn.stat(db)
            size = stat["psize"] * (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"])
            rows.append(
                (f"{label}: lmdb db {name.decode(errors='replace')}", size / 2**20, f"MiB, {stat['entries']:,} entries")
            )
    finally:
        env.close()
    data_file = state / "data.mdb"
    if data_file.exists():
        rows.append((f"{label}: lmdb state file on disk", data_file.stat().st_blocks * 512 / 2**20, "MiB"))
    return rows


def memory_rows(pid: int, label: str) -> list[Row]:
    """The process's resident memory: all, anonymous (heap), file-backed (lmdb and log pages mapped in)."""
    fields: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssFile"):
                    fields[name] = int(value.split()[0]) / 1024
    except OSError:
        return []
    return [(f"{label}: scheduler {name}", size, "MiB") for name, size in fields.items()]


async def timed(
    operations: int, batch: int, concurrency: int, call: Callable[[list[int]], Awaitable[object]], count: int
) -> float:
    """``operations`` ids in requests of ``batch`` from ``concurrency`` tasks; returns ids per second."""
    rng = random.Random(operations * 31 + batch)
    picks = rng.sample(range(count), min(operations, count))
    chunks = [picks[i : i + batch] for i in range(0, len(picks), batch)]
    started = time.perf_counter()

    async def worker(mine: Sequence[list[int]]) -> None:
        for chunk in mine:
            await call(chunk)

    async with trio.open_nursery() as nursery:
        for k in range(concurrency):
            nursery.start_soon(worker, chunks[k::concurrency])
    return len(picks) / (time.perf_counter() - started)


async def rate_rows(producer: Producer, count: int, operations: int, label: str) -> list[Row]:
    """QUERY then CANCEL rates; the cancels take ids the queries did not, and keys neither touched."""

    async def query(ns: list[int]) -> None:
        await producer.query([message_id(n) for n in ns])

    async def cancel(ns: list[int]) -> None:
        answer = await producer.cancel([message_id(n) for n in ns])
        assert all(state.state in ("cancelled", "delivered") for state in answer), answer[:3]

    async def cancel_key(ns: list[int]) -> None:
        for n in ns:
            await producer.cancel(subject="backlog", key=business_key(n))

    single = max(1, operations // 10)
    return [
        (f"{label}: QUERY, one id per request", await timed(single, 1, CONCURRENCY, query, count), "ids/s"),
        (f"{label}: QUERY, {BATCH} ids per request", await timed(operations, BATCH, 1, query, count), "ids/s"),
        (f"{label}: CANCEL, one id per request", await timed(single, 1, CONCURRENCY, cancel, count), "ids/s"),
        (f"{label}: CANCEL, {BATCH} ids per request", await timed(operations, BATCH, 1, cancel, count), "ids/s"),
        (f"{label}: CANCEL by key (2 messages each)", await timed(single, 1, CONCURRENCY, cancel_key, count), "keys/s"),
    ]


async def measure_running(servers: Servers, count: int, operations: int, label: str) -> list[Row]:
    """Memory, then the rates, then memory again, against the running servers."""
    process = servers.scheduler_process
    assert process is not None
    await wait_serving(servers.scheduler, process, time.perf_counter())
    with trio.fail_after(120):
        while True:  # the realtime server registers by itself, soon after it starts
            try:
                await wait_delivering(servers.meta)
                break
            except NoRouteError:
                await trio.sleep(0.1)  # polling another process for readiness
    found = memory_rows(process.pid, f"{label}, started")
    async with open_producer(servers.meta) as producer:
        found += await rate_rows(producer, count, operations, label)
    return found + memory_rows(process.pid, f"{label}, after the runs")


def bench_cancel(scratch: Path, *, counts: Sequence[int] | None = None, operations: int = 20_000) -> list[Row]:
    """For each count: build, measure the index, run the servers, time queries and cancels."""
    if counts is None:
        text = os.environ.get("DELAYMQ_BENCH_CANCEL_COUNTS", "")
        counts = [int(part) for part in text.split(",") if part.strip()] or list(DEFAULT_COUNTS)
    rows: list[Row] = []
    for count in counts:
        label = f"{count:,} scheduled"
        folder = scratch / f"run-{count}"
        data = folder / "scheduler"
        built = build_keyed_backlog(data, count, now_ms=int(time.time() * 1000))  # a benchmark's wall clock
        rows.append((f"{label}: build and file", built, "s"))
        rows += lmdb_rows(data / "state", label)
        with running_servers(folder, data) as servers:
            rows += trio.run(measure_running, servers, count, min(operations, count // 2), label)
        rows += lmdb_rows(data / "state", f"{label}, after the cancels")
    return rows


__all__ = ["bench_cancel", "build_keyed_backlog"]
