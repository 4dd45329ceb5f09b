"""A progress line while Spark works: the job's step and its tasks done, on standard error.

Polls Spark's status tracker from a daemon thread (Spark's own console bar is turned
off: it names stages, not what they read). On a terminal the line is rewritten in
place; otherwise a line is printed when the count moves, at most every 5 seconds.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from pyspark import SparkContext


class ProgressLine:
    def __init__(self, context: SparkContext, *, stream: TextIO = sys.stderr, interval: float = 0.5) -> None:
        self._context = context
        self._stream = stream
        self._interval = interval
        self._step = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backlog-progress", daemon=True)
        self._tty = stream.isatty()
        self._last = ""
        self._last_print = 0.0

    def step(self, what: str) -> None:
        """Name what Spark does next (also its job description in Spark's UI)."""
        self._step = what
        self._context.setJobDescription(what)
        self._show(f"backlog: {what}", force=True)

    def _run(self) -> None:
        tracker = self._context.statusTracker()
        while not self._stop.wait(self._interval):
            done = total = 0
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    total += info.numTasks
            if total:
                self._show(f"backlog: {self._step}: {done:,}/{total:,} tasks")

    def _show(self, line: str, *, force: bool = False) -> None:
        if line == self._last:
            return
        now = time.monotonic()
        if self._tty:
            self._stream.write("\r\033[K" + line)
        elif force or now - self._last_print >= 5:
            self._stream.write(line + "\n")
        else:
            return
        self._stream.flush()
        self._last, self._last_print = line, now

    def __enter__(self) -> ProgressLine:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        if self._tty and self._last:
            self._stream.write("\r\033[K")
            self._stream.flush()


__all__ = ["ProgressLine"]
