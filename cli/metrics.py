"""Prometheus metrics of a running server, mapped from what its ``statistics()`` and STATUS expose.

A scrape takes one snapshot on the server's trio thread (``MetricsSource.snapshot``:
the statistics, and for a scheduler the pending count of the next hours read as its
STATUS reads them) and a ``SnapshotCollector`` turns that snapshot into metric
families while ``generate_latest`` renders them, on the same thread, so nothing
outside the event loop ever reads server state. Counters are exposed as Prometheus
counters (``..._total``); times in seconds, sizes and log offsets in bytes.

The names are listed in docs/operations.md. This module only maps: it adds no
counting to the servers. A realtime master's counters start again from 0 when it
becomes master (Prometheus' ``rate()`` reads a drop as a reset); a scheduler's are
totals since its data folder was created.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from delaymq.cli.status_command import slave_sync
from delaymq.client.registration import software_version
from delaymq.metaserver.registry import StatusRow
from delaymq.metaserver.server import Metaserver, MetaserverStatistics
from delaymq.metaserver.wire import status_answer_row
from delaymq.net.server import ServerStatistics
from delaymq.protocol.histogram import LatencyHistogram, bucket_bounds
from delaymq.realtime.server import RealtimeServer, RealtimeStatistics
from delaymq.scheduler.server import Scheduler
from delaymq.scheduler.status import DEFAULT_STATUS_HOURS, SchedulerStatistics
from delaymq.wheel import HOUR_MS

#: Upper bounds (seconds) of the lateness histograms' buckets: from a millisecond, the
#: goal's scale, to an hour (a scheduler catching up after an outage).
LATENESS_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0,
)  # fmt: skip
#: Upper bounds (seconds) of the fsync-duration histogram's buckets: from 100 µs (a disk
#: with a write cache) to 10 s (a disk that stalls).
FSYNC_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Hours after the current one the scheduler's pending gauge has a window of its own;
#: later hours add up in the window "later".
PENDING_WINDOW_HOURS = 24


# --------------------------------------------------------------------------- helpers


def counter(name: str, documentation: str, value: float, labels: Mapping[str, str] | None = None) -> Metric:
    """One counter sample; ``name`` without ``_total`` (prometheus-client appends it)."""
    family = CounterMetricFamily(name, documentation, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), value)
    return family


def gauge(name: str, documentation: str, value: float, labels: Mapping[str, str] | None = None) -> Metric:
    family = GaugeMetricFamily(name, documentation, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), value)
    return family


def labelled(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    documentation: str,
    label: str,
    values: Mapping[str, float],
) -> Metric:
    """One family with a sample per ``label`` value (refusal reasons, hour windows, replicas)."""
    family = kind(name, documentation, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def lateness_histogram(name: str, documentation: str, wire: Mapping[str, Any]) -> Metric:
    """A ``LatencyHistogram.to_wire`` map (milliseconds) as a Prometheus histogram in seconds.

    Each log-linear bucket counts under the first bound at or above its highest value
    (capped at the largest value recorded), as its percentiles do: a lateness is never
    shown lower than it was. Early values (negative) were recorded as 0."""
    buckets, total = histogram_buckets(wire, LATENESS_BUCKETS_S, unit_s=0.001)
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total)


def histogram_buckets(
    wire: Mapping[str, Any], bounds_s: Sequence[float], *, unit_s: float
) -> tuple[list[tuple[str, float]], float]:
    """The cumulative Prometheus buckets and the sum (seconds) of a ``LatencyHistogram.to_wire``
    map whose values are in units of ``unit_s`` seconds; see ``lateness_histogram``."""
    histogram = LatencyHistogram.from_wire(wire) if wire else LatencyHistogram()
    bounds = [round(bound / unit_s) for bound in bounds_s]
    per_bound = [0] * len(bounds)
    for index, count in enumerate(histogram.counts):
        if count:
            highest = min(bucket_bounds(index)[1], histogram.max)
            slot = next((i for i, bound in enumerate(bounds) if highest <= bound), None)
            if slot is not None:
                per_bound[slot] += count
    buckets: list[tuple[str, float]] = []
    seen = 0
    for bound, count in zip(bounds_s, per_bound):
        seen += count
        buckets.append((floatToGoString(bound), seen))
    buckets.append(("+Inf", histogram.count))
    return buckets, histogram.total * unit_s


def fsync_histogram(fsync_us: Mapping[str, Mapping[str, Any]]) -> Metric:
    """``delaymq_fsync_duration_seconds`` by ``log`` from a server's ``fsync_us`` (microseconds)."""
    family = HistogramMetricFamily(
        "delaymq_fsync_duration_seconds",
        'How long fsyncs take, by log: "message" (the message log\'s group commit), '
        '"checkpoint" (a realtime checkpoint: consume and pull logs, lmdb), '
        '"schedule" (a scheduler\'s filing into schedule logs), "dispatch" (a scheduler\'s dispatch-log flush)',
        labels=["log"],
    )
    for log, wire in sorted(fsync_us.items()):
        buckets, total = histogram_buckets(wire, FSYNC_BUCKETS_S, unit_s=0.000_001)
        family.add_metric([log], buckets, total)
    return family


def log_bytes(sizes: Mapping[str, int]) -> Metric:
    """``delaymq_log_bytes`` by ``log``: what each kind of log holds on disk."""
    return labelled(GaugeMetricFamily, "delaymq_log_bytes", "Bytes each kind of log holds on disk", "log", sizes)


def server_info(kind: str, group: str, address: str | None, role: str) -> Metric:
    family = InfoMetricFamily("delaymq_server", "The server this endpoint belongs to: always 1")
    family.add_metric(
        [], {"kind": kind, "group": group, "address": address or "", "role": role, "version": software_version()}
    )
    return family


def transport_families(stats: ServerStatistics) -> Iterator[Metric]:
    """Connections and requests of a server's listener (``FrameServer.statistics``)."""
    yield gauge("delaymq_connections_open", "Client connections open now", stats.connections_open)
    yield counter("delaymq_connections_accepted", "Client connections admitted", stats.connections_total)
    yield labelled(
        CounterMetricFamily,
        "delaymq_connections_refused",
        "Connections refused or closed at a limit, by the limit",
        "reason",
        {
            "connections": stats.refused_at_connection_cap,
            "connections_per_address": stats.refused_at_address_cap,
            "file_descriptors": stats.refused_for_file_descriptors,
            "buffered_bytes": stats.refused_for_buffered_bytes,
        },
    )
    yield labelled(
        CounterMetricFamily,
        "delaymq_connections_closed",
        "Connections the server closed, by why (idle, slow frame, protocol error)",
        "reason",
        {"idle": stats.closed_idle, "slow": stats.closed_slow, "protocol_error": stats.connections_dropped},
    )
    yield counter("delaymq_requests", "Requests answered", stats.requests)
    yield counter(
        "delaymq_request_errors", "Requests answered with an error (every reason together)", stats.errors_answered
    )
    yield labelled(
        CounterMetricFamily,
        "delaymq_requests_refused",
        "Requests answered with an error, by its code (unauthorized, forbidden, rate_limited, limit, ...)",
        "reason",
        dict(sorted(stats.refused_by_reason.items())),
    )
    yield gauge("delaymq_request_buffer_bytes", "Bytes of unfinished requests held now", stats.buffered_bytes)
    yield gauge(
        "delaymq_request_buffer_peak_bytes", "Most bytes of unfinished requests held at once", stats.buffered_bytes_peak
    )


def replication_families(role: str, epoch: int, replication: Mapping[str, Any]) -> Iterator[Metric]:
    """A replicated member's role, epoch and replication state (the ``replication`` map of its statistics)."""
    yield gauge("delaymq_server_is_master", "1 while this member serves as its group's master", int(role == "master"))
    yield gauge("delaymq_server_epoch", "Group epoch of this member's session (0: standalone)", epoch)
    if "durable_end" in replication:
        yield gauge(
            "delaymq_replication_durable_end_bytes",
            "Message-log offset this member holds durably",
            replication["durable_end"],
        )
    if "high_watermark" in replication:
        yield gauge(
            "delaymq_replication_high_watermark_bytes",
            "Message-log offset every in-sync slave holds (master)",
            replication["high_watermark"],
        )
    if "in_sync_recorded" in replication:
        yield gauge(
            "delaymq_replication_in_sync_slaves",
            "Slaves in the in-sync set the metaserver recorded: every write waits for each of them (master)",
            len(replication["in_sync_recorded"]),
        )
    replicas = replication.get("replicas")
    if replicas is not None:
        by_address = {str(replica["address"]): replica for replica in replicas}
        yield labelled(
            GaugeMetricFamily,
            "delaymq_replication_replica_lag_bytes",
            "Bytes of the master's durable log a slave does not hold yet (master)",
            "replica",
            {address: replica["lag_bytes"] for address, replica in by_address.items()},
        )
        yield labelled(
            GaugeMetricFamily,
            "delaymq_replication_replica_lag_seconds",
            "How long since a slave last held everything the master had durable (master)",
            "replica",
            {address: replica["lag_ms"] / 1000 for address, replica in by_address.items()},
        )
        yield labelled(
            GaugeMetricFamily,
            "delaymq_replication_replica_in_sync",
            "1 for a slave in the in-sync set (master)",
            "replica",
            {address: int(replica["in_sync"]) for address, replica in by_address.items()},
        )
    if "lag_bytes" in replication:
        yield gauge(
            "delaymq_replication_lag_bytes",
            "Bytes of the master's durable log this slave does not hold yet (slave)",
            replication["lag_bytes"],
        )
        yield counter(
            "delaymq_replication_fetches", "FETCH requests answered by the master (slave)", replication["fetches"]
        )
        yield counter(
            "delaymq_replication_fetch_failures",
            "FETCH requests that failed, and were retried (slave)",
            replication["fetch_failures"],
        )
    for key, name, documentation in (
        ("tick_age_ms", "delaymq_replication_tick_age_seconds", "Age of the last tick the master streamed (slave)"),
        (
            "tick_behind_ms",
            "delaymq_replication_tick_behind_seconds",
            "How far the held tick is behind the clock (slave)",
        ),
    ):
        if replication.get(key) is not None:
            yield gauge(name, documentation, replication[key] / 1000)
    for key, name, documentation in (
        ("cut_records", "delaymq_replication_cut_records", "Log records cut back after a failover (not replicated)"),
        ("cut_messages", "delaymq_replication_cut_messages", "Messages in the records cut back after a failover"),
        ("cut_bytes", "delaymq_replication_cut_bytes", "Log bytes cut back after a failover"),
    ):
        if key in replication:
            yield counter(name, documentation, replication[key])


# --------------------------------------------------------------------------- per server kind


def realtime_families(stats: RealtimeStatistics, transport: ServerStatistics) -> Iterator[Metric]:
    """A realtime server's metrics from its ``RealtimeStatistics``."""
    yield server_info("realtime", stats.group, stats.address, stats.role)
    yield from replication_families(stats.role, stats.epoch, stats.replication)
    yield from transport_families(transport)
    prefix = "delaymq_realtime_"
    for key, name, documentation in (
        ("sends", "send_requests", "SEND requests answered"),
        ("messages_stored", "messages_stored", "Messages stored (accepted from producers and schedulers)"),
        ("duplicates", "duplicates", "Messages answered 'duplicate': their id was stored within the dedup window"),
        ("pulls", "pull_requests", "PULL requests answered"),
        ("messages_delivered", "messages_delivered", "Messages handed out to consumers, redeliveries included"),
        ("acks", "acks", "ACK requests answered"),
        ("nacks", "nacks", "Messages nacked by consumers"),
        ("redeliveries", "redeliveries", "Messages given back to their group (ack timeout, dead consumer, nack)"),
        ("released", "released", "Messages a closing consumer gave back without handing them out (no attempt counted)"),
        ("retries_scheduled", "retries_scheduled", "Nacked messages a scheduler took, to come back after their delay"),
        ("retries_stored", "retries_stored", "Nacked messages retried at once (no delay)"),
        ("dead_letters", "dead_lettered", "Messages moved to their dead-letter subject after the last attempt"),
        ("retries_given_back", "retries_given_back", "Nacked messages no scheduler took: given back at once"),
        ("checkpoints", "checkpoints", "Checkpoints of consumer progress committed"),
        ("checkpoint_failures", "checkpoint_failures", "Checkpoints that failed (and were retried)"),
        ("fenced", "sends_fenced", "SENDs refused for an older epoch of their scheduler group"),
        ("fence_raises", "fence_raises", "Scheduler groups' epochs raised since start"),
        ("message_log_fsyncs", "message_log_fsyncs", "fsyncs of the message log"),
    ):
        yield counter(prefix + name, documentation, getattr(stats, key))
    for key, name, documentation in (
        ("pulls_waiting", "pulls_waiting", "Long polls waiting now"),
        ("consumers", "consumers", "Consumers alive (pulled or heartbeated within the consumer timeout)"),
        ("subjects", "subjects", "Subjects with a consume log"),
        ("subjects_over_cap", "subjects_over_cap", "Subjects schedulers' SENDs made past --max-subjects"),
        ("message_log_end", "message_log_end_bytes", "Message-log end offset: bytes ever appended"),
        ("indexed_offset", "indexed_offset_bytes", "Message-log offset the consume logs index up to"),
        ("dedup_ids_in_memory", "dedup_ids", "Message ids held in memory for deduplication"),
    ):
        yield gauge(prefix + name, documentation, getattr(stats, key))
    yield lateness_histogram(
        prefix + "accept_lateness_seconds",
        "Realtime acceptance minus deliver_at (created_at for immediate messages), per new message",
        stats.lateness_accepted,
    )
    yield counter(
        prefix + "accepted_early",
        "New messages accepted before their deliver_at (counted as 0 s in the lateness histogram): "
        "those a scheduler sends ahead (--send-ahead), held until then",
        stats.lateness_accepted.get("early", 0),
    )
    yield lateness_histogram(
        prefix + "handout_lateness_seconds",
        "Hand-out to a consumer minus deliver_at (created_at for immediate messages), per message",
        stats.lateness_handed_out,
    )
    yield counter(
        prefix + "handed_out_early",
        "Messages handed out before their deliver_at (counted as 0 s in the hand-out lateness): "
        "those consumers fetching ahead (fetch_ahead) took, to hold until then",
        stats.lateness_handed_out.get("early", 0),
    )
    yield counter(
        "delaymq_messages_acked",
        "Messages consumers acked (each once; ACK requests are counted apart)",
        stats.acked_messages,
    )
    lag = GaugeMetricFamily(
        "delaymq_consumer_lag_messages",
        "Messages stored for a subject a consumer group has not acked yet "
        "(the groups with the most lag, at most 100 series)",
        labels=["group", "subject"],
    )
    for group, subject, count in stats.consumer_lag:
        lag.add_metric([group, subject], count)
    yield lag
    yield log_bytes(stats.log_bytes)
    yield fsync_histogram(stats.fsync_us)


def pending_windows(now_ms: int, hours: Sequence[int], pending: Sequence[int], total: int) -> dict[str, int]:
    """Pending messages per window: "overdue" (hours past), "0h" (this hour) .. "23h", "later".

    ``hours`` and ``pending`` are what a STATUS lists (the oldest hours with messages);
    "later" holds the rest of ``total``, the hours past the window or not listed."""
    current = now_ms // HOUR_MS
    windows = {"overdue": 0, **{f"{ahead}h": 0 for ahead in range(PENDING_WINDOW_HOURS)}, "later": 0}
    for hour, count in zip(hours, pending):
        ahead = hour - current
        if ahead < 0:
            windows["overdue"] += count
        elif ahead < PENDING_WINDOW_HOURS:
            windows[f"{ahead}h"] += count
    windows["later"] = max(0, total - sum(windows.values()))
    return windows


def scheduler_families(
    stats: SchedulerStatistics, transport: ServerStatistics, windows: Mapping[str, int] | None
) -> Iterator[Metric]:
    """A scheduler's metrics from its ``SchedulerStatistics`` and the pending counts of its STATUS hours."""
    yield server_info("scheduler", stats.group, stats.address, stats.role)
    yield from replication_families(stats.role, stats.epoch, stats.replication)
    yield from transport_families(transport)
    prefix = "delaymq_scheduler_"
    for key, name, documentation in (
        ("schedule_requests", "schedule_requests", "SCHEDULE requests answered"),
        ("scheduled", "messages_scheduled", "Messages accepted into the message log (durable)"),
        ("rewritten", "messages_rewritten", "Accepted messages already due when received: dispatched at once"),
        ("filed", "messages_filed", "Messages filed into hourly schedule logs"),
        ("dispatched", "messages_dispatched", "Messages a realtime server accepted"),
        ("dispatch_batches", "dispatch_batches", "SEND batches to realtime servers"),
        ("dispatch_failures", "dispatch_failures", "SEND attempts to realtime servers that failed (and were retried)"),
        ("fire_rounds", "fire_rounds", "Times the dispatcher fired due messages"),
        ("confirm_rounds", "confirm_rounds", "Dispatch-log rounds (one flush each)"),
        ("message_log_fsyncs", "message_log_fsyncs", "fsyncs of the message log"),
        ("filing_fsyncs", "filing_fsyncs", "fsyncs and file-system syncs of filing into schedule logs"),
        ("deleted_hours", "deleted_hours", "Fully delivered hours removed past their retention"),
        ("deleted_segments", "deleted_segments", "Message-log segments removed once filed"),
        (
            "schedule_waits",
            "schedule_waits",
            "SCHEDULE requests that waited for filing to catch up (max_unfiled_bytes)",
        ),
        (
            "damaged_records",
            "damaged_records",
            "Schedule-log records that did not check when read to be sent (damage on disk): skipped",
        ),
        (
            "lost_log_bytes",
            "lost_log_bytes",
            "Message-log bytes found lost below the filed offset on open (filed already: no message lost)",
        ),
    ):
        yield counter(prefix + name, documentation, getattr(stats, key))
    for key, name, documentation in (
        ("message_log_end", "message_log_end_bytes", "Message-log end offset: bytes ever appended"),
        ("checkpoint", "filed_offset_bytes", "Message-log offset filing into schedule logs has reached"),
        ("unfiled_bytes", "unfiled_bytes", "Message-log bytes not yet filed into schedule logs"),
        ("message_log_bytes", "message_log_bytes", "Bytes of message-log segments on disk"),
        ("message_log_segments", "message_log_segments", "Message-log segments on disk"),
        ("hours", "hours_pending", "Hours with undelivered messages"),
        ("open_hours", "open_hours", "Hours on a second wheel now"),
        ("loaded", "loaded_entries", "Entries in memory: read ahead, or sent and not yet confirmed"),
        ("buffered", "buffered_entries", "Replay arrivals waiting for a disk read of their open hour"),
        ("cached_records", "cached_records", "Records read ahead"),
        ("delivered_held", "delivered_held_entries", "Delivered entry numbers of the open hours held in memory"),
        ("lanes", "lanes", "Subjects with records on the way to realtime"),
        ("waiting", "waiting_records", "Records handed out to realtime, not yet accepted"),
        ("in_outage", "in_outage", "1 while delivery to realtime is failing"),
    ):
        yield gauge(prefix + name, documentation, int(getattr(stats, key)))
    yield gauge(prefix + "tick_timestamp_seconds", "Epoch second the wheel is dispatching", stats.tick.second)
    yield gauge(
        prefix + "dispatch_lateness_max_seconds",
        "Worst realtime acceptance minus deliver_at since start (0 while every message is sent ahead)",
        stats.lateness_max_ms / 1000,
    )
    yield lateness_histogram(
        prefix + "fire_lateness_seconds",
        "Fired minus deliver_at, per message (fired ahead, with --send-ahead: counted as 0)",
        stats.lateness_fired,
    )
    yield log_bytes({"message": stats.message_log_bytes, **stats.log_bytes})
    yield fsync_histogram(stats.fsync_us)
    if stats.pending >= 0:  # a master's (a slave's wheel is idle)
        yield gauge(prefix + "pending_messages", "Messages filed, not yet recorded as delivered", stats.pending)
    if windows is not None:
        yield labelled(
            GaugeMetricFamily,
            prefix + "pending_window_messages",
            'Pending messages by delivery hour: "overdue", "0h" (this hour) .. "23h" hours ahead, "later"',
            "window",
            windows,
        )


def metaserver_families(stats: MetaserverStatistics, rows: Sequence[StatusRow]) -> Iterator[Metric]:
    """The metaserver's metrics: registry counts and, per server it knows, heartbeat age and replica lag."""
    yield server_info("metaserver", "", stats.address, "metaserver")
    yield from transport_families(stats.transport)
    registry = stats.registry
    prefix = "delaymq_metaserver_"
    for key, name, documentation in (
        ("groups", "groups", "Server groups registered"),
        ("servers", "servers", "Servers registered"),
        ("routed_groups", "routed_groups", "Groups that routes point at"),
        ("evicted_groups", "evicted_groups", "Groups whose master is silent past the eviction time"),
        ("evicted_servers", "evicted_servers", "Servers silent past the eviction time"),
        ("version", "route_version", "Route version"),
    ):
        yield gauge(prefix + name, documentation, getattr(registry, key))
    yield counter(prefix + "registry_changes", "Changes to the registry (servers, roles, states)", registry.changes)
    yield counter(prefix + "snapshots_written", "Registry snapshots written to disk", stats.snapshots_written)
    yield gauge(
        prefix + "restored_servers", "Servers restored from the registry snapshot at start", stats.restored_servers
    )
    labels = ["group", "kind", "address"]
    age = GaugeMetricFamily(prefix + "heartbeat_age_seconds", "Seconds since a server's last heartbeat", labels=labels)
    up = GaugeMetricFamily(prefix + "server_up", "1 for a server heartbeating within the eviction time", labels=labels)
    master = GaugeMetricFamily(prefix + "server_is_master", "1 for the master routes point at", labels=labels)
    lag = GaugeMetricFamily(
        prefix + "replica_lag_bytes",
        "A slave's last reported durable offset behind its master's (replicated groups)",
        labels=labels,
    )
    epochs = GaugeMetricFamily(
        prefix + "group_epoch", "A replicated group's epoch (0: not replicated)", labels=["group"]
    )
    master_offsets = {row.group: row.offset for row in rows if row.is_master and row.offset is not None}
    for row in rows:
        values = [row.group, str(row.kind), row.address]
        age.add_metric(values, row.seconds_since_heartbeat)
        up.add_metric(values, int(not row.evicted))
        master.add_metric(values, int(row.is_master))
        if not row.is_master and row.offset is not None and row.group in master_offsets:
            lag.add_metric(values, max(0, master_offsets[row.group] - row.offset))
    for group, epoch in sorted({row.group: row.epoch for row in rows}.items()):
        epochs.add_metric([group], epoch)
    yield from (age, up, master, lag, epochs)
    yield from replica_set_families(rows)


def replica_set_families(rows: Sequence[StatusRow]) -> Iterator[Metric]:
    """Per replicated group: its slaves in the recorded in-sync set, and whether one is outside it."""
    prefix = "delaymq_metaserver_"
    in_sync = GaugeMetricFamily(
        prefix + "group_in_sync_slaves", "Slaves in a replicated group's recorded in-sync set", labels=["group"]
    )
    under = GaugeMetricFamily(
        prefix + "group_under_replicated",
        "1 while a replicated group has a slave outside its in-sync set (a dead or lagging member)",
        labels=["group"],
    )
    for group, (members, out) in sorted(slave_sync(status_answer_row(row) for row in rows).items()):
        in_sync.add_metric([group], len(members))
        under.add_metric([group], int(bool(out)))
    yield from (in_sync, under)


# --------------------------------------------------------------------------- scraping


class MetricsSource(Protocol):
    """What the endpoint scrapes: a snapshot taken on the trio thread, then its families."""

    async def snapshot(self) -> Any: ...

    def families(self, snapshot: Any) -> Iterable[Metric]: ...


@dataclass(frozen=True, slots=True)
class RealtimeSource:
    server: RealtimeServer

    async def snapshot(self) -> tuple[RealtimeStatistics, ServerStatistics]:
        return self.server.statistics(), self.server.frame_server.statistics()

    def families(self, snapshot: tuple[RealtimeStatistics, ServerStatistics]) -> Iterable[Metric]:
        return realtime_families(*snapshot)


@dataclass(frozen=True, slots=True)
class SchedulerSource:
    scheduler: Scheduler

    async def snapshot(self) -> tuple[SchedulerStatistics, ServerStatistics, dict[str, int] | None]:
        scheduler = self.scheduler
        stats = scheduler.statistics()
        transport = scheduler.frame_server.statistics()
        if stats.pending < 0:
            return stats, transport, None
        # As STATUS lists them: the oldest hours with messages, read through the blocking runner.
        hours = scheduler.wheels.hours()[:DEFAULT_STATUS_HOURS]
        store = scheduler.store
        pending = await scheduler.member.run_blocking(lambda: [store.pending(hour) for hour in hours])
        now = scheduler.member.clock.now_ms()
        return stats, transport, pending_windows(now, hours, pending, stats.pending)

    def families(
        self, snapshot: tuple[SchedulerStatistics, ServerStatistics, dict[str, int] | None]
    ) -> Iterable[Metric]:
        return scheduler_families(*snapshot)


@dataclass(frozen=True, slots=True)
class MetaserverSource:
    metaserver: Metaserver

    async def snapshot(self) -> tuple[MetaserverStatistics, list[StatusRow]]:
        metaserver = self.metaserver
        return metaserver.statistics(), metaserver.registry.status(metaserver.steady_ms())

    def families(self, snapshot: tuple[MetaserverStatistics, list[StatusRow]]) -> Iterable[Metric]:
        return metaserver_families(*snapshot)


class SnapshotCollector(Collector):
    """Collects the families of the snapshot it holds (set by ``Exposition.render`` just before)."""

    def __init__(self, families: Callable[[Any], Iterable[Metric]]) -> None:
        self._families = families
        self.snapshot: Any = None

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self.snapshot))


class Exposition:
    """The text a scrape of one server answers: its snapshot's families and the process's own."""

    def __init__(self, source: MetricsSource) -> None:
        self._source = source
        self._collector = SnapshotCollector(source.families)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)
        ProcessCollector(registry=self._registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    async def render(self) -> bytes:
        """Take a snapshot, then render it, both on the calling (trio) thread."""
        self._collector.snapshot = await self._source.snapshot()
        try:
            return generate_latest(self._registry)
        finally:
            self._collector.snapshot = None


__all__ = [
    "FSYNC_BUCKETS_S",
    "LATENESS_BUCKETS_S",
    "Exposition",
    "MetaserverSource",
    "MetricsSource",
    "RealtimeSource",
    "SchedulerSource",
    "fsync_histogram",
    "histogram_buckets",
    "lateness_histogram",
    "metaserver_families",
    "pending_windows",
    "realtime_families",
    "replica_set_families",
    "scheduler_families",
]
