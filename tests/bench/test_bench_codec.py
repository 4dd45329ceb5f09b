"""The codec benchmark runs and reports figures (their size is not asserted)."""

from __future__ import annotations

import math

from delaymq.bench.codec import bench_codec


def test_bench_codec_reports_named_positive_figures() -> None:
    results = bench_codec(records=2_000)
    names = [name for name, _value, _unit in results]
    assert {"encode_batch", "scan_batch", "decode_batch", "frame_round_trip_1000_records"} <= set(names)
    assert len(names) == len(set(names))
    for _name, value, unit in results:
        assert math.isfinite(value) and value > 0
        assert unit in {"records/s", "frames/s", "MB/s"}
