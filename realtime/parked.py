"""Long polls waiting for their subject: one ``ParkingLot`` per subject while any pull waits.

A waiting PULL costs nothing until an entry for its subject is indexed, or
messages of its subject are given back (a timeout, a nack); then every pull
parked on that subject wakes and picks again.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio


class ParkedPulls:
    """The pulls parked per subject, and how many there are."""

    def __init__(self) -> None:
        self._lots: dict[str, trio.lowlevel.ParkingLot] = {}
        self.count = 0

    async def wait(self, subject: str, deadline: float) -> None:
        """Park until ``subject`` is woken or trio's clock reaches ``deadline``."""
        lot = self._lots.get(subject)
        if lot is None:
            lot = self._lots[subject] = trio.lowlevel.ParkingLot()
        self.count += 1
        try:
            with trio.move_on_at(deadline):
                await lot.park()
        finally:
            self.count -= 1
            if not lot and self._lots.get(subject) is lot:
                del self._lots[subject]

    def wake(self, subjects: Iterable[str]) -> None:
        """Wake every pull parked on one of ``subjects``."""
        lots = self._lots
        for subject in subjects:
            lot = lots.get(subject)
            if lot is not None:
                lot.unpark_all()

    def wake_all(self) -> None:
        """Wake every parked pull (the master session ends: they are answered at once)."""
        self.wake(list(self._lots))


__all__ = ["ParkedPulls"]
