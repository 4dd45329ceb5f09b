"""A server process collects cycles less often than CPython's default (``tune_collector``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from delaymq.cli.serving import SERVER_GC_THRESHOLDS, tune_collector


@pytest.fixture
def collector() -> Iterator[None]:
    """Give the test process its collector back as it was."""
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_a_server_process_collects_less_often_and_never_scans_what_start_up_left(collector: None) -> None:
    start_up = [[i] for i in range(1000)]  # containers alive before serving, like imported modules
    tune_collector()
    assert gc.get_threshold() == SERVER_GC_THRESHOLDS
    assert SERVER_GC_THRESHOLDS[0] > 700  # CPython's default collects the youngest generation every 700
    assert gc.get_freeze_count() >= len(start_up)
    scanned = {id(obj) for obj in gc.get_objects()}  # what a collection looks at: not the frozen
    assert not any(id(obj) in scanned for obj in start_up)
