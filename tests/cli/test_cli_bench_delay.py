"""``delaymq bench delay`` says where a delayed message's lateness and the servers' CPU go.

A small run (300 messages due within a second) against a real ``delaymq cluster``:
the printed figures are not asserted (benchmarks never assert timings), but that each
stage is reported, that every message passed each stage once, and that nothing was
lost, duplicated or early, are. When ``redis-server`` and the ``redis`` client are
installed the same invocation runs the Redis sorted-set queue and prints ratios;
otherwise it says it skipped that.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from delaymq.bench.cluster import STAGES, bench_delay
from delaymq.bench.redis_queue import bench_redis_delay, redis_client_missing
from delaymq.cli.bench_command import print_rows

COUNT = 300


@pytest.mark.slow
def test_bench_delay_prints_each_stage_the_cpu_of_each_server_and_the_redis_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = bench_delay(
        tmp_path,
        count=COUNT,
        backlog=0,
        delay_range=(0.2, 1.0),
        flushes=("sync",),
        at_the_moment=False,
        redis=True,
        install_redis=False,
        bursts=2,
    )
    print_rows("delay", rows)
    out = capsys.readouterr().out
    figures = {name: value for name, value, _unit in rows}

    for label in [label for label, _kind, _field in STAGES] + ["received by the consumer"]:
        assert figures[f"sync: due -> {label}, messages"] == COUNT
        for percentile in ("p50", "p99", "max"):
            assert f"sync: due -> {label} {percentile}" in out
    assert figures["sync: lost"] == 0 and figures["sync: duplicated"] == 0 and figures["sync: delivered early"] == 0

    cpu = [name.split("CPU per 100,000 msgs, ", 1)[1] for name in figures if "CPU per 100,000 msgs, " in name]
    served = sorted(server for process in cpu if process != "all server processes" for server in process.split("+"))
    assert {"metaserver", "realtime", "scheduler"} <= set(served)
    assert len(served) == len(set(served))  # each server's CPU counted once
    assert figures["sync: dispatch batches (SENDs to realtime)"] >= 1
    assert 1 <= figures["sync: dispatch batch mean size"] <= COUNT
    assert figures["sync: fsyncs/s, realtime message log"] > 0  # sync: every SEND answered after an fsync

    # The accept rate alone, a burst into a fresh cluster at a time: their median and spread.
    slowest, median, fastest = (
        figures[f"sync: accepted, {which} of 2 bursts"] for which in ("slowest", "median", "fastest")
    )
    assert 0 < slowest <= median <= fastest

    if redis_client_missing() is None and shutil.which("redis-server"):
        assert figures["Redis ZSET: lost"] == 0 and figures["Redis ZSET: delivered early"] == 0
        assert "sync / Redis: accepted" in out and "sync / Redis: server CPU" in out
        redis_median = figures["Redis ZSET: accepted, median of 2 bursts"]
        assert figures["sync / Redis: accepted, median of 2 bursts"] == pytest.approx(100 * median / redis_median)
    else:
        assert "the Redis comparison is skipped" in out


@pytest.mark.slow
def test_the_redis_queue_delivers_every_message_once_and_never_early(tmp_path: Path) -> None:
    if redis_client_missing() is not None or shutil.which("redis-server") is None:
        pytest.skip("redis-server or the redis client package is not installed")
    run, why = bench_redis_delay(tmp_path, count=COUNT, delay_range=(0.2, 1.0), install=False)
    assert run is not None, why
    assert len(run.lateness_ms) == COUNT
    assert run.lost == 0 and run.duplicated == 0
    assert min(run.lateness_ms) >= 0
