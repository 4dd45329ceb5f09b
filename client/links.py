"""A consumer's realtime groups, the pacing of its pulls and ack rounds, and its statistics.

``GroupLink`` is one realtime group of the consumer route as the consumer sees it:
its address, one ``AckTracker`` per subject pulled, the backoffs of failed pulls.
``ConsumerStatistics`` is the snapshot ``ConsumerCore.statistics`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from delaymq.client.acks import AckTracker
from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource

#: The wait after a failed pull, before that subject is pulled from that group again.
#: "Equal" jitter: at least half the ceiling, so a consumer never pulls a group that is
#: down in a tight loop, while the consumers that lost it together come back spread out.
#: The cap bounds how long after a restarted group is back its consumers pull it again.
PULL_BACKOFF = Backoff(initial_ms=100, maximum_ms=500, jitter="equal")
#: The wait after an ACK/NACK round that could not deliver everything, before the next round
#: (the ranges stay queued meanwhile). A group's move to a new master ends the wait at once.
SETTLE_BACKOFF = Backoff(initial_ms=100, maximum_ms=5_000, jitter="equal")
#: ACK/NACK rounds start at least this far apart (seconds; ``Consumer.flush`` and closing
#: do not wait): each ACK waits for a checkpoint of the realtime server (fsyncs and an lmdb
#: transaction), so the acks of a round's worth of messages travel as one range instead
#: of one request and one checkpoint every few milliseconds. Acks are at-least-once
#: either way: a consumer that dies has its unsent acks' messages handed out again. A quarter
#: of a second cost the realtime server about a fifth less CPU than 0.1 s (docs/performance.md).
SETTLE_INTERVAL = 0.25
#: At most this many ACK/NACK requests of one round on the way at once (each is one range).
SETTLE_CONCURRENCY = 16
#: The longest poll (ms) of a consumer with a ``limit`` whose reservation may be what another
#: lane will want (``PullLimit.brief``): a lane with messages waits at most this long for it.
LIMITED_POLL_MS = 250


def pull_backoffs(random: RandomSource | None = None) -> tuple[BackoffRun, BackoffRun]:
    return BackoffRun(PULL_BACKOFF, random=random), BackoffRun(PULL_BACKOFF, random=random)


@dataclass(slots=True)
class GroupLink:
    """One realtime group this consumer pulls from: the subject, and the group's retry subject."""

    name: str
    address: str
    # One pull log per subject pulled: [0] the subject, [1] the group's retry subject.
    trackers: tuple[AckTracker, AckTracker] = field(default_factory=lambda: (AckTracker(), AckTracker()))
    active: bool = True  # still in the consumer route
    # The backoff after failed pulls, per subject pulled (as ``trackers``).
    backoffs: tuple[BackoffRun, BackoffRun] = field(default_factory=pull_backoffs)

    @property
    def tracker(self) -> AckTracker:
        """The subject's pull log (``trackers[1]`` is the retry subject's)."""
        return self.trackers[0]


@dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    subject: str
    group: str
    consumer_id: str
    server_groups: tuple[str, ...]
    held_messages: int
    held_bytes: int
    received: int  # messages taken from the servers for the application (fetched ahead: on arrival)
    filtered: int  # messages the server's tag mask let through and the exact check dropped
    acked: int
    nacked: int
    pulls: int
    pull_failures: int
    gaps_nacked: int  # sequences handed out but never seen (lost answers), given back
    settle_failures: int  # ACK/NACK requests that failed (retried)
    retried: int = 0  # nacks that asked for a retry after a delay
    dead: int = 0  # nacks of a last attempt: sent to the dead-letter subject
    received_retries: int = 0  # messages that came back from the retry subject
    released: int = 0  # messages never handed to the application, given back as they were (closing)


__all__ = [
    "LIMITED_POLL_MS",
    "PULL_BACKOFF",
    "SETTLE_BACKOFF",
    "SETTLE_CONCURRENCY",
    "SETTLE_INTERVAL",
    "ConsumerStatistics",
    "GroupLink",
    "pull_backoffs",
]
