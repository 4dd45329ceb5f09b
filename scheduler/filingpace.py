"""When a master files what it accepted: accepting goes first, filing follows.

A SCHEDULE is answered once its batch is in the message log (fsynced, replicated as
the policy asks); filing it into hourly schedule logs, the id index and the wheel is
replay's work, done later (``replay_step``). Both run in one interpreter, so a replay
step running while a burst of SCHEDULEs arrives takes the interpreter from them: a
burst was answered at the pace of accepting *and* filing. ``FilingPace`` lets replay
wait while SCHEDULEs keep coming, as QMQ's delay server files its message log behind
its appends, and bounds the wait by what the wait may cost:

- nothing due within ``lead_ms`` waits (``send_ahead`` and the time to file are in it),
  nor anything after a CANCEL or MOVE (a cancel is filed at once);
- a pause in accepting of ``quiet_ms`` starts filing, so light traffic is filed at once;
- nothing accepted waits longer than ``max_wait_ms``;
- ``max_bytes`` unfiled start filing at once, below the SCHEDULE backpressure bound
  (``Scheduler._filing_room``), so a burst that long is not refused meanwhile.

Sans-IO: fed the appends and the filed checkpoint, asked how long replay may wait.
Intervals are on the monotonic clock, so a step of the wall clock moves only the
``deliver_at`` deadline (which is on the wall clock, like ``deliver_at`` itself).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Anything due within this of now (besides ``send_ahead``) is filed without waiting.
DEFAULT_FILING_LEAD_MS = 1_000
#: A pause in accepting this long starts filing.
DEFAULT_FILING_QUIET_MS = 20
#: Nothing accepted waits longer than this to be filed.
DEFAULT_FILING_MAX_WAIT_MS = 1_000
#: The "earliest deliver_at" of an append that is filed at once (a CANCEL or MOVE).
_AT_ONCE = -(1 << 62)


@dataclass(frozen=True, slots=True)
class FilingPaceStatistics:
    batches: int  # appends not yet filed
    waits: int  # times replay waited for accepting to pause


class FilingPace:
    """How long replay may wait before filing the appends not filed yet."""

    def __init__(self, *, lead_ms: int, quiet_ms: int, max_wait_ms: int, max_bytes: int) -> None:
        for name, value in (("lead_ms", lead_ms), ("quiet_ms", quiet_ms), ("max_wait_ms", max_wait_ms)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self.lead_ms = lead_ms
        self.quiet_ms = quiet_ms
        self.max_wait_ms = max_wait_ms
        self.max_bytes = max_bytes
        #: Each append not yet filed: (log offset after it, earliest deliver_at, monotonic ms
        #: when appended); and the earliest of those deliver_ats.
        self._appends: deque[tuple[int, int, int]] = deque()
        self._earliest = _AT_ONCE
        self._waits = 0

    def appended(self, end: int, earliest_at: int | None, monotonic_ms: int) -> None:
        """Records up to log offset ``end`` were appended; the earliest ``deliver_at`` among
        them is ``earliest_at`` (None: something in them, a CANCEL or MOVE, is filed at once)."""
        at = _AT_ONCE if earliest_at is None else earliest_at
        self._earliest = min(self._earliest, at) if self._appends else at
        self._appends.append((end, at, monotonic_ms))

    def filed(self, checkpoint: int) -> None:
        """Replay filed everything below ``checkpoint``."""
        appends = self._appends
        if appends and appends[0][0] <= checkpoint:
            while appends and appends[0][0] <= checkpoint:
                appends.popleft()
            self._earliest = min((at for _, at, _ in appends), default=_AT_ONCE)

    def wait_ms(self, *, now_ms: int, monotonic_ms: int, unfiled_bytes: int) -> int:
        """How long replay may wait before filing (0: file now). Nothing tracked (a log
        with unfiled records nobody appended here, say) is filed now."""
        appends = self._appends
        if not appends or unfiled_bytes >= self.max_bytes:
            return 0
        wait = min(
            self._earliest - self.lead_ms - now_ms,
            appends[-1][2] + self.quiet_ms - monotonic_ms,
            appends[0][2] + self.max_wait_ms - monotonic_ms,
        )
        if wait <= 0:
            return 0
        self._waits += 1
        return wait

    def statistics(self) -> FilingPaceStatistics:
        return FilingPaceStatistics(batches=len(self._appends), waits=self._waits)


__all__ = [
    "DEFAULT_FILING_LEAD_MS",
    "DEFAULT_FILING_MAX_WAIT_MS",
    "DEFAULT_FILING_QUIET_MS",
    "FilingPace",
    "FilingPaceStatistics",
]
