"""The pieces of the metrics endpoint: histogram buckets, pending windows, HTTP answers."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import trio
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from delaymq.cli.metrics import Exposition, lateness_histogram, pending_windows, replica_set_families
from delaymq.cli.metrics_endpoint import MAX_SCRAPES, open_metrics_endpoint
from delaymq.cli.status_command import format_under_replicated
from delaymq.metaserver.answers import StatusRow
from delaymq.metaserver.requests import Role
from delaymq.metaserver.wire import status_answer_row
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.protocol.routes import GroupState, ServerKind
from delaymq.wheel import HOUR_MS

from .test_metrics_cluster import http_get


def buckets(family: Metric) -> dict[str, float]:
    return {sample.labels["le"]: sample.value for sample in family.samples if sample.name.endswith("_bucket")}


def test_lateness_histogram_counts_each_value_under_the_first_bound_at_or_above_it() -> None:
    recorded = LatencyHistogram()
    recorded.record_many([0, 1, 1, 2, 7, 10, 150, 2_000, 4_000_000, -3])
    family = lateness_histogram("delaymq_test_lateness_seconds", "test", recorded.to_wire())
    counts = buckets(family)
    assert counts["0.001"] == 4  # 0, 1, 1 and the early -3 (recorded as 0)
    assert counts["0.002"] == 5 and counts["0.005"] == 5
    assert counts["0.01"] == 7  # 7 and 10
    assert counts["0.1"] == 7 and counts["0.2"] == 8  # 150 ms
    # 2 s shares its log-linear bucket with values up to 2.015 s: counted under 5 s, never shown lower.
    assert counts["2.0"] == 8 and counts["5.0"] == 9
    assert counts["3600.0"] == 9 and counts["+Inf"] == 10  # 4,000 s is past the last bound
    total = next(s.value for s in family.samples if s.name.endswith("_sum"))
    assert total == pytest.approx(recorded.total / 1000)


def test_a_value_just_above_a_bound_is_never_shown_below_it() -> None:
    recorded = LatencyHistogram()
    recorded.record_many([101, 101, 99])  # 101 ms shares a log-linear bucket with 100 ms .. 101 ms
    counts = buckets(lateness_histogram("delaymq_test_seconds", "test", recorded.to_wire()))
    assert counts["0.1"] == 1 and counts["0.2"] == 3


def test_an_empty_histogram_has_zero_counts() -> None:
    counts = buckets(lateness_histogram("delaymq_test_seconds", "test", {}))
    assert set(counts.values()) == {0}


def test_pending_windows_put_each_hour_in_its_window_and_the_rest_in_later() -> None:
    now = 1_000 * HOUR_MS + 1_234
    hours = [998, 999, 1_000, 1_003, 1_023, 1_024, 1_500]
    pending = [1, 2, 3, 4, 5, 6, 7]
    windows = pending_windows(now, hours, pending, total=sum(pending) + 10)
    assert windows["overdue"] == 3 and windows["0h"] == 3 and windows["3h"] == 4 and windows["23h"] == 5
    assert windows["later"] == 6 + 7 + 10  # past the window, and what the listed hours do not hold
    assert sum(windows.values()) == sum(pending) + 10
    assert len(windows) == 1 + 24 + 1


class CountingSource:
    """A metrics source with fixed families, counting its snapshots."""

    def __init__(self) -> None:
        self.snapshots = 0

    async def snapshot(self) -> int:
        self.snapshots += 1
        return self.snapshots

    def families(self, snapshot: int) -> Iterable[Metric]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("delaymq_test_snapshots", "Snapshots taken")
        family.add_metric([], snapshot)
        return [family]


class _Failing(CountingSource):
    def families(self, snapshot: int) -> Iterable[Metric]:
        raise RuntimeError("a mapping bug")


async def test_the_endpoint_answers_metrics_404_405_400_and_head() -> None:
    source = CountingSource()
    async with open_metrics_endpoint(Exposition(source), "127.0.0.1:0") as endpoint:
        status, headers, body = await http_get(endpoint.address)
        assert status == "HTTP/1.1 200 OK" and headers["connection"] == "close"
        families = {family.name: family for family in text_string_to_metric_families(body.decode())}
        assert families["delaymq_test_snapshots"].samples[0].value == 1  # read at scrape time
        assert "process_cpu_seconds" in families
        status, _, body = await http_get(endpoint.address)
        assert status == "HTTP/1.1 200 OK" and b"delaymq_test_snapshots_total 2.0" in body
        assert (await http_get(endpoint.address, "/other"))[0] == "HTTP/1.1 404 Not Found"
        assert (await http_get(endpoint.address, method="POST"))[0] == "HTTP/1.1 405 Method Not Allowed"
        status, headers, body = await http_get(endpoint.address, method="HEAD")
        assert status == "HTTP/1.1 200 OK" and body == b"" and int(headers["content-length"]) > 0
        host, port = endpoint.address.split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(b"hello\r\n\r\n")
            assert (await stream.receive_some(100)).startswith(b"HTTP/1.1 400 Bad Request")
    assert source.snapshots == 3


async def test_a_failing_scrape_answers_500_and_the_endpoint_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    async with open_metrics_endpoint(Exposition(_Failing()), "127.0.0.1:0") as endpoint:
        assert (await http_get(endpoint.address))[0] == "HTTP/1.1 500 Internal Server Error"
        assert (await http_get(endpoint.address))[0] == "HTTP/1.1 500 Internal Server Error"
    assert caplog.text.count("metrics: the scrape failed") == 2


async def test_silent_connections_past_the_cap_do_not_stop_scrapes_for_long() -> None:
    """Connections that send nothing hold a slot each; past the cap new ones are closed, and
    once the silent ones go, scrapes are answered again."""
    async with open_metrics_endpoint(Exposition(CountingSource()), "127.0.0.1:0") as endpoint:
        host, port = endpoint.address.split(":")
        silent = [await trio.open_tcp_stream(host, int(port)) for _ in range(MAX_SCRAPES)]
        with trio.fail_after(10):
            while True:  # the server has taken every silent one: a new connection is closed unanswered
                extra = await trio.open_tcp_stream(host, int(port))
                async with extra:
                    await extra.send_all(b"GET /metrics HTTP/1.1\r\n\r\n")
                    if await extra.receive_some(100) == b"":
                        break
                await trio.sleep(0.01)
        for stream in silent:
            await stream.aclose()
        with trio.fail_after(10):
            while (await http_get(endpoint.address))[0] != "HTTP/1.1 200 OK":
                await trio.sleep(0.01)


def row(group: str, role: Role, address: str, *, epoch: int, in_sync: bool = False) -> StatusRow:
    return StatusRow(
        group=group, kind=ServerKind.SCHEDULER, role=role, address=address, state=GroupState.RW,
        software_version="0", seconds_since_heartbeat=0.1, evicted=False, is_master=role is Role.MASTER,
        epoch=epoch, in_sync=in_sync,
    )  # fmt: skip


def test_a_group_with_a_slave_outside_its_in_sync_set_is_named_under_replicated() -> None:
    rows = [
        row("s1", Role.MASTER, "a:1", epoch=7),
        row("s1", Role.SLAVE, "b:1", epoch=7, in_sync=True),
        row("s1", Role.SLAVE, "c:1", epoch=7),
        row("s2", Role.MASTER, "d:1", epoch=9),
        row("s2", Role.SLAVE, "e:1", epoch=9, in_sync=True),
        row("plain", Role.MASTER, "f:1", epoch=0),  # not replicated: never under-replicated
    ]
    families = {family.name: family for family in replica_set_families(rows)}
    under = {s.labels["group"]: s.value for s in families["delaymq_metaserver_group_under_replicated"].samples}
    in_sync = {s.labels["group"]: s.value for s in families["delaymq_metaserver_group_in_sync_slaves"].samples}
    assert under == {"s1": 1, "s2": 0} and in_sync == {"s1": 1, "s2": 1}
    assert format_under_replicated([status_answer_row(r) for r in rows]) == [
        "group s1 is under-replicated: 1 of 2 slave(s) in sync (not in sync: c:1)"
    ]
