"""A bound on the file descriptors a server's many small logs hold: the least recently used close.

Consume logs (one per subject) and pull logs (one per consumer) each keep a descriptor
open while they are in use, so the hot path (a ``pwrite`` per subject per indexed batch,
one per PULL) opens nothing; ``OpenFiles`` closes the least recently used past its
``limit``, so many subjects or consumers never exhaust the process's descriptors. A log
whose descriptor is closed opens it again on its next write; a worker thread's read or
fsync meanwhile opens the file by its path.

A log closes its descriptor only under its own lock, which a worker thread holds while it
uses the descriptor (a read, an fsync): one busy at eviction is closed on a later call
instead (the number could otherwise be reused by another open under the thread's feet).
One thread at a time uses an ``OpenFiles`` (a master's event loop; a slave's apply step).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class HeldFile(Protocol):
    """What ``OpenFiles`` needs of a log: its descriptor (-1: closed), and opening and closing it."""

    _fd: int

    def _open(self) -> int:
        """The descriptor, opened if need be."""
        ...

    def _close(self, *, wait: bool = False) -> bool:
        """Close the descriptor; False if a worker thread holds it now and not ``wait``."""
        ...


class OpenFiles:
    """The logs holding a descriptor, least recently used first: at most ``limit`` (one that a
    worker thread holds at eviction stays open a little longer, in ``_closing``)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"open files: limit must be at least 1, not {limit}")
        self.limit = limit
        self._held: OrderedDict[HeldFile, None] = OrderedDict()
        self._closing: dict[HeldFile, None] = {}  # evicted while busy: closed on a later call
        self.closed = False  # the owner stopped: a late write opens and closes its file itself

    def __len__(self) -> int:
        """Descriptors open (the held ones and those waiting to close)."""
        return len(self._held) + len(self._closing)

    def fd(self, log: HeldFile) -> int:
        """``log``'s descriptor, opened if need be; it becomes the most recently used."""
        held = self._held
        if log in held:
            held.move_to_end(log)
        else:
            log._open()  # still open if its close was deferred
            self._closing.pop(log, None)
            held[log] = None
            while len(held) > self.limit:
                oldest, _ = held.popitem(last=False)
                if not oldest._close():
                    self._closing[oldest] = None
        if self._closing:
            self._retry_closing()
        return log._fd

    def forget(self, log: HeldFile, *, wait: bool = False) -> None:
        """Close ``log``'s descriptor (it leaves memory; ``wait``: for a worker thread using it)."""
        self._held.pop(log, None)
        if log._close(wait=wait):
            self._closing.pop(log, None)
        else:
            self._closing[log] = None

    def close(self) -> None:
        """Close every descriptor (the owner stops: waits for a worker thread's use in flight)."""
        self.closed = True
        for log in [*self._held, *self._closing]:
            log._close(wait=True)
        self._held.clear()
        self._closing.clear()

    def _retry_closing(self) -> None:
        for log in [log for log in self._closing if log._close()]:
            del self._closing[log]


__all__ = ["HeldFile", "OpenFiles"]
