"""The FORMAT file beside the data, and the append benchmark's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from delaymq.bench.log import bench_log_append
from delaymq.storage.errors import FormatMismatch, FormatUnreadable
from delaymq.storage.format import ensure_format, read_format


def test_first_use_writes_the_parameters_then_later_uses_compare(tmp_path: Path) -> None:
    assert read_format(tmp_path) is None
    params = {"format": "schedule-log", "version": 1, "entry_size": 24}
    assert ensure_format(tmp_path, params, has_data=False) == params
    assert json.loads((tmp_path / "FORMAT").read_text()) == params
    assert [p.name for p in tmp_path.iterdir()] == ["FORMAT"]  # no temp file left behind
    assert ensure_format(tmp_path, params, has_data=True) == params
    with pytest.raises(FormatMismatch) as caught:
        ensure_format(tmp_path, {"format": "schedule-log", "version": 2, "slots": 3600}, has_data=True)
    assert caught.value.differences == [
        ("entry_size", 24, None),
        ("slots", None, 3600),
        ("version", 1, 2),
    ]
    message = str(caught.value)
    assert "entry_size: stored 24, requested absent" in message
    assert "slots: stored absent, requested 3600" in message
    assert "version: stored 1, requested 2" in message


def test_an_unreadable_format_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "FORMAT").write_text("{not json")
    with pytest.raises(FormatUnreadable, match=r"FORMAT is not valid JSON"):
        ensure_format(tmp_path, {"format": "x"}, has_data=False)
    (tmp_path / "FORMAT").write_text("[1, 2]")
    with pytest.raises(FormatUnreadable, match="must hold a JSON object, found list"):
        read_format(tmp_path)


def test_bench_returns_rates_for_every_case_and_cleans_up(tmp_path: Path) -> None:
    rows = bench_log_append(tmp_path, seconds_per_case=0.02, appenders=4)
    cases = {case for case, _value, _unit in rows}
    assert len(cases) == 8
    assert "log append sync batch=1 appenders=4" in cases
    assert "log append async batch=1000 appenders=1" in cases
    assert {unit for _case, _value, unit in rows} == {"records/s", "MB/s", "fsyncs/s"}
    assert all(value > 0 for _case, value, unit in rows if unit != "fsyncs/s")
    assert list(tmp_path.iterdir()) == []
