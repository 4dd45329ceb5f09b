"""The keys (message ids, dedup keys) of log appends under way, so a request meeting one waits.

A record whose id is being appended right now is not yet stored: a second copy of it must
wait for that append (a duplicate once it is stored, stored anew if the append fails), and a
cancel of it must wait to see where it went. Realtime's SEND and the scheduler's SCHEDULE,
CANCEL and MOVE each keep their appends in flight here. Each append is one set of keys
with the event set when it ends, so marking and clearing a batch is one step, not one per
key; lookups walk the appends in flight, which are few (one per request being written).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import trio


class KeysInFlight:
    """Appends under way, each with its keys and the event set when it ends."""

    def __init__(self) -> None:
        self._appends: dict[trio.Event, set[str]] = {}

    def __bool__(self) -> bool:
        return bool(self._appends)

    def __contains__(self, key: str) -> bool:
        return any(key in keys for keys in self._appends.values())

    def start(self, keys: Iterable[str]) -> trio.Event:
        """An append of ``keys`` begins; give the event back to ``end`` whatever happens to it."""
        done = trio.Event()
        self._appends[done] = set(keys)
        return done

    def end(self, done: trio.Event) -> None:
        """That append is over (stored or refused): whoever waits for it looks again."""
        del self._appends[done]
        done.set()

    def waiting_for(self, keys: Collection[str]) -> trio.Event | None:
        """The end of an append holding any of ``keys``, or None when none does."""
        return next((done for done, held in self._appends.items() if not held.isdisjoint(keys)), None)


__all__ = ["KeysInFlight"]
