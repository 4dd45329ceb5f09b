"""``delaymq bench realtime``: a realtime server's accept rate and latency, alone and with a sync slave.

First the local cluster's figures (``bench_cluster.bench_realtime``: one producer and one
consumer, flush sync and async, batches of 100 and 1,000). Then replication: a metaserver
and a realtime group, each server its own ``delaymq`` process (``open_replicated_group``,
as ``delaymq bench failover`` uses), one producer sending immediate messages in batches of
100 with ``IN_FLIGHT`` batches in flight, into a master with one sync slave
(``--min-insync 1``: a SEND is answered once the slave holds it too) and into a master
alone (``--min-insync 0``). Printed, never asserted: the accept rate, the SEND latency
(one batch, first try to answer) p50/p99/max, and the ratio of the two rates (the goal is >= 0.9:
docs/performance.md, "Goals").
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import trio

from delaymq.bench import cluster as bench_cluster
from delaymq.bench.cluster import Row, percentiles
from delaymq.bench.failover import Tally, open_replicated_group, send_all


async def send_rate(root: Path, count: int, *, slaves: int) -> tuple[float, list[float]]:
    """Immediate msg/s of one producer into a fresh realtime group with sync replication to ``slaves``
    slaves (``--min-insync`` as many), and the latency of each batch in ms."""
    latencies_ms: list[float] = []
    async with open_replicated_group(root, kind="realtime", slaves=slaves, min_insync=slaves) as group:
        accepted = await send_all(group.meta.address, count, Tally(), delay=None, latencies_ms=latencies_ms)
    return accepted, latencies_ms


def replication_rows(scratch: Path, *, count: int) -> list[Row]:
    """``count`` immediate messages into a realtime master with one sync slave, then into one alone."""
    rows: list[Row] = []
    rates: list[float] = []
    for slaves, case in ((1, "sync to 1 slave"), (0, "no slave (min-insync 0)")):
        accepted, latencies = trio.run(partial(send_rate, scratch / f"replicated-{slaves}", count, slaves=slaves))
        p50, p99, worst = percentiles(latencies)
        rates.append(accepted)
        rows += [
            (f"{count:,} sent, {case}: accepted", accepted, "msg/s"),
            (f"{count:,} sent, {case}: SEND latency (100 msgs) p50", p50, "ms"),
            (f"{count:,} sent, {case}: SEND latency (100 msgs) p99", p99, "ms"),
            (f"{count:,} sent, {case}: SEND latency (100 msgs) max", worst, "ms"),
        ]
    replicated, single = rates
    rows.append(("accept rate, sync slave / no slave", 100 * replicated / single if single else 0.0, "%"))
    return rows


def bench_realtime(scratch: Path, *, count: int = 100_000, replicated_count: int = 20_000) -> list[Row]:
    """The local cluster's figures for ``count`` messages, then replication's for ``replicated_count``."""
    return [
        *bench_cluster.bench_realtime(scratch, count=count),
        *replication_rows(scratch, count=replicated_count),
    ]


__all__ = ["bench_realtime", "replication_rows", "send_rate"]
