"""Tick: the wheel's position in one small value (docs/architecture.md, "Replication and fencing").

A master streams its tick to its slaves every 50 ms; a slave that becomes master starts
its wheel from the last tick it got (``SecondWheel.skip_to``). So the tick must be a
*claim that is never wrong*: everything it says is done has been accepted by a realtime
server. Saying too little only means re-sending a few messages (the realtime server drops
duplicates by message id); saying too much would lose messages.

``Tick(second, done, limit)`` claims, for the UTC hour holding epoch second ``second``:

* every entry numbered below ``limit`` in an earlier second of that hour is done, and
  every entry of every earlier hour is done;
* of the entries of ``second`` numbered below ``limit``, taken in the fixed firing order
  (millisecond within the hour, then entry number), the first ``done`` are done.

Why ``limit`` (the number of index entries of the hour the master knew): entries are
numbered 0, 1, 2, ... in filing order, so "below ``limit``" is exactly the set of entries
the master had seen when it made the tick. A slave may already have filed a newer entry
(it replays the replicated message log on its own schedule) that sorts before the
master's position; without ``limit`` the slave would count that unsent entry among the
first ``done`` and skip it. ``Tick(second, done)`` leaves ``limit`` at ``NO_LIMIT``.

When every entry a wheel knows is done, its tick is the hour's last second with all of
that second's entries done, not the next hour's start: a claim about the next hour
would cover every entry of this one, including any filed after the tick. The claim
about earlier hours is unbounded, so the scheduler keeps two rules: it files an overdue
``deliver_at`` at "now" (never into an hour before the current one), and it streams the
tick of the earliest hour that is not done or of the current hour, whichever is earlier
(an empty ``SecondWheel`` of the current hour gives a tick that claims nothing).

The tick is normally monotonic. It moves back when a message is linked into a moment
the wheel has already passed (its deliver_at is in the past): the position then stops
before that message until it is confirmed, since claiming it would lose it.

Wire form: ``encode()`` gives 17 bytes, big-endian ``version:u8 second:i64 done:u32
limit:u32``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from delaymq.wheel.hours import SECONDS_PER_HOUR, WheelError

TICK_VERSION = 1
NO_LIMIT = 0xFFFF_FFFF  # also the most index entries one hour may hold
_U32_MAX = 0xFFFF_FFFF
_I64_MAX = 2**63 - 1
_TICK = struct.Struct(">BqII")
TICK_SIZE = _TICK.size


@dataclass(frozen=True, slots=True)
class Tick:
    """Wheel position: epoch ``second`` being dispatched and ``done`` of its entries."""

    second: int
    done: int = 0
    limit: int = NO_LIMIT

    def __post_init__(self) -> None:
        if not isinstance(self.second, int) or not 0 <= self.second <= _I64_MAX:
            raise WheelError(f"tick second={self.second!r}: must be an int in 0..{_I64_MAX}")
        if not isinstance(self.done, int) or not 0 <= self.done <= _U32_MAX:
            raise WheelError(f"tick done={self.done!r}: must be an int in 0..{_U32_MAX}")
        if not isinstance(self.limit, int) or not 0 <= self.limit <= _U32_MAX:
            raise WheelError(f"tick limit={self.limit!r}: must be an int in 0..{_U32_MAX}")

    @property
    def hour(self) -> int:
        """The UTC hour number the tick's second falls in."""
        return self.second // SECONDS_PER_HOUR

    @classmethod
    def start_of(cls, hour: int) -> Tick:
        """The tick before anything of ``hour`` is done (all earlier hours are)."""
        return cls(hour * SECONDS_PER_HOUR, 0, 0)

    def encode(self) -> bytes:
        """The fixed 17-byte wire form streamed master -> slave."""
        return _TICK.pack(TICK_VERSION, self.second, self.done, self.limit)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Tick:
        """Parse ``encode()`` output; refuse a wrong size or version."""
        if len(data) != TICK_SIZE:
            raise WheelError(f"tick size={len(data)}: must be exactly {TICK_SIZE} bytes")
        version, second, done, limit = _TICK.unpack(data)
        if version != TICK_VERSION:
            raise WheelError(f"tick version={version}: only version {TICK_VERSION} is known")
        return cls(second, done, limit)


__all__ = ["NO_LIMIT", "TICK_SIZE", "TICK_VERSION", "Tick"]
