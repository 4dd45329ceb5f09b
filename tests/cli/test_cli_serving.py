"""A server process, and each benchmark run, collects cycles less often than CPython's default
(``tuned_collector``)."""

from __future__ import annotations

import gc

import pytest

from delaymq.net.serving import SERVER_GC_THRESHOLDS, tuned_collector


def test_a_server_collects_less_often_never_scans_what_start_up_left_and_gives_the_collector_back() -> None:
    start_up = [[i] for i in range(1000)]  # containers alive before serving, like imported modules
    before = gc.get_threshold()
    with tuned_collector():
        assert gc.get_threshold() == SERVER_GC_THRESHOLDS
        assert SERVER_GC_THRESHOLDS[0] > 700  # CPython's default collects the youngest generation every 700
        assert gc.get_freeze_count() >= len(start_up)
        scanned = {id(obj) for obj in gc.get_objects()}  # what a collection looks at: not the frozen
        assert not any(id(obj) in scanned for obj in start_up)
    # A server run in-process (a test calling ``main``) leaves the process's collector as it was.
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_benchmark_run_that_fails_gives_the_collector_back() -> None:
    """A benchmark run freezes the earlier runs' results (their collections' pauses are not the
    next run's lateness); they are collected as usual again after it, even when it fails."""
    held = [[n] for n in range(1000)]  # an earlier run's results: tracked containers
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), tuned_collector():
        assert gc.get_freeze_count() >= len(held)
        raise RuntimeError("the run failed")
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
