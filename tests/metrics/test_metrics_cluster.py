"""The metrics endpoints of a running cluster show what a known workload implies.

A metaserver, a realtime server and a scheduler on loopback with the real clock, each
with its metrics endpoint (as ``--metrics-listen`` opens it); a producer sends and
schedules known counts, two consumer groups take everything, one nacks a message into
a retry an hour away, the other one into its dead letters. The endpoints are scraped
over HTTP and the text is parsed with prometheus-client's own parser.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import trio
from prometheus_client.parser import text_string_to_metric_families

from delaymq.cli.metrics import Exposition, MetaserverSource, RealtimeSource, SchedulerSource
from delaymq.cli.metrics_endpoint import open_metrics_endpoint
from delaymq.client import open_consumer, open_producer
from delaymq.client.delivery import ReceivedMessage
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.realtime.consumelog import ENTRY_SIZE
from delaymq.realtime.pulllog import PULL_ENTRY_SIZE
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import open_scheduler

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def http_get(address: str, path: str = "/metrics", method: str = "GET") -> tuple[str, dict[str, str], bytes]:
    """One HTTP request; the status line, the headers (lower-case names) and the body."""
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("ascii").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return status, headers, body


async def scrape(address: str) -> tuple[Samples, dict[str, str]]:
    """The samples of an endpoint by (name, labels), and each family's type."""
    status, headers, body = await http_get(address)
    assert status == "HTTP/1.1 200 OK" and headers["content-type"].startswith("text/plain; version=")
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


async def scrape_until(address: str, name: str, wanted: float, **labels: str) -> Samples:
    """Scrape until ``name`` reads ``wanted`` (a count the servers reach a moment after the client sees it)."""
    with trio.fail_after(20):
        while True:
            samples, _ = await scrape(address)
            if samples.get((name, frozenset(labels.items()))) == wanted:
                return samples
            await trio.sleep(0.05)


async def scrape_until_above(address: str, name: str, floor: float, **labels: str) -> Samples:
    """Scrape until ``name`` reads more than ``floor``."""
    with trio.fail_after(20):
        while True:
            samples, _ = await scrape(address)
            if samples.get((name, frozenset(labels.items())), floor) > floor:
                return samples
            await trio.sleep(0.05)


@asynccontextmanager
async def metrics_cluster(tmp_path: Path) -> AsyncIterator[tuple[str, str, str, str]]:
    """(metaserver address, metaserver metrics, realtime metrics, scheduler metrics)."""
    clock = SystemClock()
    async with AsyncExitStack() as stack:
        meta = await stack.enter_async_context(open_metaserver(data_dir=tmp_path / "meta", clock=clock))
        realtime = await stack.enter_async_context(
            open_realtime_server(data_dir=tmp_path / "rt", clock=clock, meta_address=meta.address, flush="async")
        )
        scheduler = await stack.enter_async_context(
            open_scheduler(data_dir=tmp_path / "sched", clock=clock, meta_address=meta.address)
        )
        endpoints = [
            await stack.enter_async_context(open_metrics_endpoint(Exposition(source), "127.0.0.1:0"))
            for source in (MetaserverSource(meta), RealtimeSource(realtime), SchedulerSource(scheduler))
        ]
        yield meta.address, *(endpoint.address for endpoint in endpoints)  # type: ignore[misc]


async def test_metrics_of_a_cluster_show_the_counts_of_a_known_workload(tmp_path: Path) -> None:
    immediate, due, later = 5, 20, 3
    async with metrics_cluster(tmp_path) as (meta, meta_metrics, rt_metrics, sched_metrics):
        with trio.fail_after(30):
            async with (
                open_consumer(meta, "orders", group="g", start="earliest", retry_delays=[3600]) as retrying,
                open_consumer(meta, "orders", group="dl", start="earliest", max_attempts=1) as dying,
            ):
                async with open_producer(meta) as producer:
                    await producer.send_batch([producer.message("orders", f"now {n}") for n in range(immediate)])
                    await producer.send_batch([producer.message("orders", f"due {n}", delay=0.2) for n in range(due)])
                    await producer.send_batch(
                        [producer.message("orders", f"later {n}", delay=7_200) for n in range(later)]
                    )
                received: list[list[ReceivedMessage]] = []
                for consumer in (retrying, dying):
                    got: list[ReceivedMessage] = []
                    while len(got) < immediate + due:
                        got += await consumer.receive_batch()
                    assert len(got) == immediate + due
                    received.append(got)
                handed_out, _ = await scrape(rt_metrics)  # each group holds all 25, none acked yet
                for got in received:
                    await got[0].nack()  # "g": comes back in an hour, through the scheduler; "dl": dead
                    for message in got[1:]:
                        await message.ack()
                # The retry reaches the scheduler; the dead letter is stored on the realtime server.
                rt = await scrape_until(rt_metrics, "delaymq_realtime_retries_scheduled_total", 1)
                rt = await scrape_until(rt_metrics, "delaymq_realtime_dead_lettered_total", 1)
            # Closed, each consumer has flushed its acks.
            after, _ = await scrape(rt_metrics)
            # Under flush="async" the message log is fsynced every 20 ms: wait for the first.
            rt_fsynced = await scrape_until_above(rt_metrics, "delaymq_fsync_duration_seconds_count", 0, log="message")
            sched = await scrape_until(sched_metrics, "delaymq_scheduler_messages_dispatched_total", due)
            meta_samples, meta_types = await scrape(meta_metrics)
            _, rt_types = await scrape(rt_metrics)

    # The realtime server: 25 messages stored, the dead letter too; each group got all 25.
    delivered = immediate + due
    assert value(rt, "delaymq_realtime_messages_stored_total") == delivered + 1
    assert value(rt, "delaymq_realtime_messages_delivered_total") == 2 * delivered
    assert value(rt, "delaymq_realtime_duplicates_total") == 0
    assert value(rt, "delaymq_realtime_nacks_total") == 2  # one NACK per group
    assert value(rt, "delaymq_realtime_redeliveries_total") == 0  # both nacked messages were placed
    assert value(rt, "delaymq_realtime_retries_given_back_total") == 0
    assert value(after, "delaymq_realtime_acks_total") >= 2  # ACK requests: at least one per group
    # Acked messages: each group acked all it got but the one it nacked.
    assert value(after, "delaymq_messages_acked_total") == 2 * (delivered - 1)
    # Consumer lag: all 25 stored were unacked by each group, then none are.
    for group in ("g", "dl"):
        assert value(handed_out, "delaymq_consumer_lag_messages", group=group, subject="orders") == delivered
        assert value(after, "delaymq_consumer_lag_messages", group=group, subject="orders") == 0
    assert sum(v for (name, _), v in after.items() if name == "delaymq_consumer_lag_messages") == 0
    # Log sizes: 25 "orders" entries and the dead letter in consume logs, 2 x 25 hand-outs in pull logs.
    assert value(after, "delaymq_log_bytes", log="message") >= value(after, "delaymq_realtime_message_log_end_bytes")
    assert value(after, "delaymq_log_bytes", log="consume") == (delivered + 1) * ENTRY_SIZE
    assert value(after, "delaymq_log_bytes", log="pull") == 2 * delivered * PULL_ENTRY_SIZE
    # fsync durations: one per fsync of the message log, one per checkpoint written (an ACK waits for one).
    fsyncs = value(rt_fsynced, "delaymq_realtime_message_log_fsyncs_total")
    assert value(rt_fsynced, "delaymq_fsync_duration_seconds_count", log="message") == fsyncs > 0
    assert value(rt_fsynced, "delaymq_fsync_duration_seconds_bucket", log="message", le="+Inf") == fsyncs
    checkpoints = value(rt_fsynced, "delaymq_realtime_checkpoints_total")
    assert value(rt_fsynced, "delaymq_fsync_duration_seconds_count", log="checkpoint") == checkpoints > 0
    assert value(rt_fsynced, "delaymq_fsync_duration_seconds_sum", log="checkpoint") > 0
    assert rt_types["delaymq_fsync_duration_seconds"] == "histogram"
    assert rt_types["delaymq_consumer_lag_messages"] == "gauge"
    assert value(rt, "delaymq_realtime_consumers") == 2 * 2  # each pulls its subject and its group's retries
    # Every message a SEND stored is in the acceptance lateness (the dead letter was appended, not sent).
    assert value(rt, "delaymq_realtime_accept_lateness_seconds_count") == delivered
    assert value(rt, "delaymq_realtime_accept_lateness_seconds_bucket", le="+Inf") == delivered
    assert value(rt, "delaymq_realtime_accepted_early_total") == 0
    assert value(rt, "delaymq_realtime_handout_lateness_seconds_count") == 2 * delivered
    assert value(rt, "delaymq_realtime_handed_out_early_total") == 0  # nothing was sent ahead here
    assert value(rt, "delaymq_server_info", kind="realtime", group="realtime-1", **_info_rest(rt, "realtime")) == 1
    assert value(rt, "delaymq_server_is_master") == 1
    assert value(rt, "delaymq_connections_open") >= 1
    assert rt_types["delaymq_realtime_messages_stored"] == "counter"
    assert rt_types["delaymq_realtime_accept_lateness_seconds"] == "histogram"
    assert rt_types["delaymq_realtime_consumers"] == "gauge"

    # The scheduler: the 23 scheduled and the retry; the 20 due ones dispatched, 4 pending.
    assert value(sched, "delaymq_scheduler_messages_scheduled_total") == due + later + 1
    assert value(sched, "delaymq_scheduler_messages_dispatched_total") == due
    assert value(sched, "delaymq_scheduler_schedule_waits_total") == 0  # filing kept up
    assert value(sched, "delaymq_scheduler_fire_lateness_seconds_count") == due
    assert value(sched, "delaymq_scheduler_pending_messages") == later + 1
    windows = {
        dict(labels)["window"]: count
        for (name, labels), count in sched.items()
        if name == "delaymq_scheduler_pending_window_messages"
    }
    assert windows["overdue"] == windows["later"] == 0
    # The retry is due in an hour, the three others in two: within the next three hours' windows.
    assert windows["0h"] + windows["1h"] == 1 or windows["1h"] + windows["2h"] == 1
    assert sum(windows[f"{ahead}h"] for ahead in range(1, 4)) >= later
    assert sum(windows.values()) == later + 1
    assert value(sched, "delaymq_scheduler_dispatch_failures_total") == 0
    # flush="sync": every SCHEDULE was fsynced before its answer, each fsync timed.
    sched_fsyncs = value(sched, "delaymq_scheduler_message_log_fsyncs_total")
    assert value(sched, "delaymq_fsync_duration_seconds_count", log="message") == sched_fsyncs > 0
    assert value(sched, "delaymq_log_bytes", log="message") == value(sched, "delaymq_scheduler_message_log_bytes") > 0

    # The metaserver knows the two servers, both heartbeating.
    assert value(meta_samples, "delaymq_metaserver_servers") == 2
    assert value(meta_samples, "delaymq_metaserver_groups") == 2
    ups = [v for (name, _labels), v in meta_samples.items() if name == "delaymq_metaserver_server_up"]
    assert ups == [1, 1]
    assert meta_types["delaymq_metaserver_registry_changes"] == "counter"
    assert value(meta_samples, "delaymq_metaserver_registry_changes_total") >= 2
    assert value(meta_samples, "process_resident_memory_bytes") > 0


def _info_rest(samples: Samples, kind: str) -> dict[str, str]:
    """The labels of the ``delaymq_server_info`` sample of ``kind`` besides kind and group."""
    for name, labels in samples:
        found = dict(labels)
        if name == "delaymq_server_info" and found.get("kind") == kind:
            return {key: item for key, item in found.items() if key not in ("kind", "group")}
    raise AssertionError(f"no delaymq_server_info of kind {kind}")


DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def documented_metrics() -> dict[str, str]:
    """The names in docs/operations.md's tables, with what the row says (``(slave)`` etc.)."""
    rows: dict[str, str] = {}
    for line in DOCS.read_text().splitlines():
        if line.startswith("| `delaymq_"):
            name = line.split("`")[1]
            rows[name] = line
    return rows


def exposed_names(types: dict[str, str]) -> set[str]:
    return {
        name + "_total" if kind == "counter" else name for name, kind in types.items() if name.startswith("delaymq_")
    }


async def test_the_metrics_a_cluster_exposes_are_the_ones_docs_operations_lists(tmp_path: Path) -> None:
    async with metrics_cluster(tmp_path) as (_, *endpoints):
        exposed: set[str] = set()
        for endpoint in endpoints:
            exposed |= exposed_names((await scrape(endpoint))[1])
    documented = documented_metrics()
    assert sorted(exposed - set(documented)) == []
    # What a standalone master does not expose: a slave's replication figures.
    unseen = set(documented) - exposed
    assert unseen and all("(slave)" in documented[name] or "(scheduler slave)" in documented[name] for name in unseen)
