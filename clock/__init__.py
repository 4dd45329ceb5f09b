"""delaymq.clock: where time comes from.

Everything that reads the time takes a ``Clock`` (``SystemClock`` in a server, ``TrioClock``
in tests, so a two-year schedule runs in milliseconds); ``Alarm`` wakes a task at a wall
moment however the clock steps.
"""

from delaymq.clock.alarm import Alarm
from delaymq.clock.clocks import STEP_WARN_MS, WALL_RECHECK_MS, AheadClock, Clock, StepWatch, SystemClock, TrioClock

__all__ = ["STEP_WARN_MS", "WALL_RECHECK_MS", "AheadClock", "Alarm", "Clock", "StepWatch", "SystemClock", "TrioClock"]
