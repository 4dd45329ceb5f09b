"""What a scheduler member is run with: ``SchedulerSettings``, checked as it is built.

``open_scheduler`` takes the settings as keywords (or a ``SchedulerSettings`` whole);
the clock, the blocking runner and the peer connections are what it runs on, not
settings, and stay keywords of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from delaymq.net.addresses import split_listen
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.scheduler.dispatcher import (
    DEFAULT_DISPATCH_BATCH,
    DEFAULT_SEND_AHEAD_MS,
    DEFAULT_SEND_INTERVAL_MS,
    MAX_SEND_AHEAD_MS,
)
from delaymq.scheduler.hours import DEFAULT_RETENTION_MS
from delaymq.scheduler.replay import DEFAULT_STEP_BYTES, REPLAY_RECENT_BYTES
from delaymq.scheduler.wheelset import DEFAULT_HOUR_PRELOAD_MS, DEFAULT_LOAD_AHEAD_MS, DEFAULT_MAX_LOADED, WheelSet
from delaymq.storage.log import check_max_record
from delaymq.storage.writer import FlushPolicy

DEFAULT_CLEANUP_INTERVAL_MS = 60_000
#: The write-ahead message log's segment size: filed segments are deleted whole, so the
#: bytes of the active segment are what the log may hold after filing (docs/scheduler-storage.md).
SCHEDULER_SEGMENT_SIZE = 64 << 20
#: How long a SCHEDULE waits for ``min_insync`` slaves under sync replication.
DEFAULT_REPLICATION_TIMEOUT_MS = 5_000
#: A SCHEDULE waits while replay is more than this far behind (``ScheduleHandler``):
#: under the bytes the message log keeps in memory, so replay files from there.
DEFAULT_MAX_UNFILED_BYTES = REPLAY_RECENT_BYTES * 3 // 4


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerSettings:
    """One member's settings; a bad value raises ``ValueError`` before the data folder is touched.

    ``listen=None`` opens no listener (connections go to ``serve_stream``; give
    ``advertise_address`` to register). ``meta_address`` (one or several) is where the
    scheduler registers (kind ``scheduler``) and asks for realtime groups to deliver to.
    ``limits.horizon_ms`` is how far ahead a message may be scheduled. ``replay_bytes`` is
    how much of the message log one replay step files at most (the step's memory; one
    commit and fsync round per step). ``max_unfiled_bytes``: a SCHEDULE waits while replay
    is further behind than that (``ScheduleHandler``). ``segment_size``: the message log's
    segments; a folder written with another size takes this one (``SchedulerStorage``).
    ``send_interval_ms``: a subject's SENDs to realtime start at least this far apart (what
    falls due meanwhile goes in one batch; ``Dispatcher``). ``send_ahead_ms``: each message
    is fired that long before its ``deliver_at`` (realtime holds it until then; at most
    ``MAX_SEND_AHEAD_MS``).
    """

    data_dir: str | Path
    listen: str | None = "127.0.0.1:0"
    group: str = "scheduler-1"
    meta_address: str | Sequence[str] | None = None
    advertise_address: str | None = None
    flush: FlushPolicy = "sync"
    limits: Limits = DEFAULT_LIMITS
    load_ahead_ms: int = DEFAULT_LOAD_AHEAD_MS
    hour_preload_ms: int = DEFAULT_HOUR_PRELOAD_MS
    retention_ms: int = DEFAULT_RETENTION_MS
    cleanup_interval_ms: int = DEFAULT_CLEANUP_INTERVAL_MS
    dispatch_batch: int = DEFAULT_DISPATCH_BATCH
    send_interval_ms: int = DEFAULT_SEND_INTERVAL_MS
    send_ahead_ms: int = DEFAULT_SEND_AHEAD_MS
    max_loaded: int = DEFAULT_MAX_LOADED
    replay_bytes: int = DEFAULT_STEP_BYTES
    max_unfiled_bytes: int = DEFAULT_MAX_UNFILED_BYTES
    send_timeout: float = 10.0
    segment_size: int = SCHEDULER_SEGMENT_SIZE
    replication: str = "sync"
    min_insync: int = 0
    replication_timeout_ms: int = DEFAULT_REPLICATION_TIMEOUT_MS

    def __post_init__(self) -> None:
        check_max_record(self.limits.max_record)
        self._check_durations()
        self._check_sizes()
        if self.replication not in ("sync", "async"):
            raise ValueError(f"replication must be 'sync' or 'async', got {self.replication!r}")
        if self.min_insync < 0:
            raise ValueError(f"min_insync must be >= 0, got {self.min_insync}")
        if self.replication_timeout_ms <= 0:
            raise ValueError(f"replication_timeout_ms must be positive, got {self.replication_timeout_ms}")
        self.bind  # noqa: B018  (a listen address that does not parse is refused here)
        if self.listen is None and self.meta_address is not None and self.advertise_address is None:
            raise ValueError("listen=None with a meta_address needs an advertise_address to register")
        self.make_wheels([])  # the wheel settings

    def _check_durations(self) -> None:
        if self.retention_ms < 0:
            raise ValueError(f"retention_ms must be >= 0, got {self.retention_ms}")
        if self.cleanup_interval_ms <= 0:
            raise ValueError(f"cleanup_interval_ms must be positive, got {self.cleanup_interval_ms}")
        if self.send_timeout <= 0:
            raise ValueError(f"send_timeout must be positive, got {self.send_timeout}")
        if self.send_interval_ms < 0:
            raise ValueError(f"send_interval_ms must be >= 0, got {self.send_interval_ms}")
        if not 0 <= self.send_ahead_ms <= MAX_SEND_AHEAD_MS:
            raise ValueError(f"send_ahead_ms must be between 0 and {MAX_SEND_AHEAD_MS}, got {self.send_ahead_ms}")

    def _check_sizes(self) -> None:
        if self.replay_bytes < 1:
            raise ValueError(f"replay_bytes must be at least 1, got {self.replay_bytes}")
        if self.max_unfiled_bytes < 1:
            raise ValueError(f"max_unfiled_bytes must be at least 1, got {self.max_unfiled_bytes}")

    @property
    def root(self) -> Path:
        """The data folder."""
        return Path(self.data_dir)

    @property
    def bind(self) -> tuple[str, int] | None:
        """Where to listen (None: no listener)."""
        return split_listen(self.listen) if self.listen is not None else None

    @property
    def meta_addresses(self) -> list[str] | None:
        """The metaserver addresses (None: standalone, master for good)."""
        if self.meta_address is None:
            return None
        return [self.meta_address] if isinstance(self.meta_address, str) else list(self.meta_address)

    def make_wheels(self, hours: list[int]) -> WheelSet:
        """A master's wheels over the hours not fully dispatched."""
        return WheelSet(
            hours, load_ahead_ms=self.load_ahead_ms, hour_preload_ms=self.hour_preload_ms, max_loaded=self.max_loaded
        )


__all__ = [
    "DEFAULT_CLEANUP_INTERVAL_MS",
    "DEFAULT_MAX_UNFILED_BYTES",
    "DEFAULT_REPLICATION_TIMEOUT_MS",
    "SCHEDULER_SEGMENT_SIZE",
    "SchedulerSettings",
]
