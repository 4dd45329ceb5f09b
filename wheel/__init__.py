"""delaymq.wheel: the pure timing structures of the delay path (docs/architecture.md, "The delay path").

``HourWheel`` (which hours hold undelivered messages), ``SecondWheel`` (one hour's
seconds, fired at each message's own millisecond), ``Tick`` (the wheel position a master
streams to its slaves).
"""

from delaymq.wheel.hours import (
    HOUR_MS,
    SECOND_MS,
    SECONDS_PER_HOUR,
    HourWheel,
    WheelError,
    hour_of,
    hour_start_ms,
)
from delaymq.wheel.seconds import DEFAULT_AHEAD_MS, SecondWheel, WheelCounts
from delaymq.wheel.tick import NO_LIMIT, TICK_SIZE, Tick

__all__ = [
    "DEFAULT_AHEAD_MS",
    "HOUR_MS",
    "NO_LIMIT",
    "SECONDS_PER_HOUR",
    "SECOND_MS",
    "TICK_SIZE",
    "HourWheel",
    "SecondWheel",
    "Tick",
    "WheelCounts",
    "WheelError",
    "hour_of",
    "hour_start_ms",
]
