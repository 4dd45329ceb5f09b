"""A realtime server's counters and state, as ``RealtimeServer.statistics`` and STATUS report them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from delaymq.replication.roles import Role
from delaymq.replication.statistics import CutCounts, ReplicationStatistics

#: The counters a master keeps (``RealtimeMaster.counters``); all 0 while not master.
COUNTERS = ("sends messages_stored duplicates pulls pulls_waiting messages_delivered acks nacks redeliveries released "
             "retries_scheduled retries_stored dead_letters retries_given_back consumers subjects indexed_offset "
             "dedup_ids_in_memory checkpoints checkpoint_failures fenced fence_raises "
             "subjects_over_cap").split()  # fmt: skip


def _no_replication() -> ReplicationStatistics:
    return ReplicationStatistics(mode="sync", min_insync=0, durable_end=0, history=[], cut=CutCounts(messages=0))


@dataclass(frozen=True, slots=True)
class RealtimeStatistics:
    """A snapshot of a realtime server's counters."""

    address: str
    group: str
    sends: int  # SEND requests answered
    messages_stored: int
    duplicates: int  # records answered "duplicate"
    pulls: int  # PULL requests answered
    pulls_waiting: int  # long polls parked right now
    messages_delivered: int  # records handed out, redeliveries included
    acks: int
    nacks: int
    redeliveries: int  # messages given back to their group (timeouts, dead consumers, nacks)
    released: int  # messages a closing consumer gave back unseen (no attempt counted)
    retries_scheduled: int  # nacked messages a scheduler took, to come back after their delay
    retries_stored: int  # nacked messages retried at once (delay 0), appended here
    dead_letters: int  # nacked messages of a last attempt, appended to their dead-letter subject
    retries_given_back: int  # nacked messages no scheduler took: given back to the group at once
    consumers: int  # consumers alive (pulled or heartbeated within the consumer timeout)
    subjects: int
    message_log_end: int
    indexed_offset: int
    dedup_ids_in_memory: int
    checkpoints: int
    checkpoint_failures: int
    fenced: int  # SENDs refused for an older epoch of their scheduler group
    fence_raises: int  # scheduler groups' epochs raised (committed) since start
    role: str = Role.MASTER.value  # a ``delaymq.replication.roles.Role``'s value
    epoch: int = 0
    master: str = ""  # the group's master as the metaserver says (this server's address standalone)
    # On the wire as ``ReplicationStatistics.to_wire`` (``to_wire``); read in-process as that map too.
    replication: ReplicationStatistics = field(default_factory=_no_replication)
    # Lateness stages of the delay path, ms (``LatencyHistogram.to_wire``; ``delaymq bench delay``):
    lateness_accepted: dict[str, Any] = field(default_factory=dict)  # SEND accepted - due, per record
    lateness_handed_out: dict[str, Any] = field(default_factory=dict)  # PULL handed out - due, per record
    message_log_fsyncs: int = 0  # fsyncs of the message log (its writer's)
    acked_messages: int = 0  # pull-log entries settled by ACKs (each once), not requests
    subjects_over_cap: int = 0  # subjects schedulers' SENDs made past --max-subjects (``caps.SubjectCap``)
    # (group, subject, messages not acked yet) of the pairs with the most lag (``MAX_LAG_SERIES``; master)
    consumer_lag: list[tuple[str, str, int]] = field(default_factory=list)
    log_bytes: dict[str, int] = field(default_factory=dict)  # "message" on disk; "consume", "pull" (master)
    # How long fsyncs take, µs (``LatencyHistogram.to_wire``): "message" (the log writer's group
    # commit), "checkpoint" (a master's checkpoint write: consume and pull logs, lmdb)
    fsync_us: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The map STATUS answers with (field order kept; ``replication`` as its wire map)."""
        wire = asdict(self)
        wire["replication"] = self.replication.to_wire()
        return wire


__all__ = ["COUNTERS", "RealtimeStatistics"]
