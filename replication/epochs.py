"""EpochHistory: where each epoch's writes begin in a replicated log (Kafka's leader-epoch cache).

Every promotion gives a group a new epoch (the metaserver decides it); the new master
records ``(epoch, its log end)`` before it accepts anything, and its slaves copy the
list with the bytes. So two members can tell where their logs part: a slave that held
epoch ``e`` last asks its master where ``e``'s writes end in the master's log
(``end_of``); anything the slave holds past that point the master never had (a
deposed master's unreplicated tail), and the slave cuts it (``SegmentedLog.truncate``).

Sans-IO: a list of pairs and its rules; ``load``/``save`` put it in the member's lmdb
state (db ``replication``, key ``epochs``), written before the member acts on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from delaymq.storage.state import StateStore, pack, unpack

DB = "replication"
KEY = b"epochs"
#: Entries kept: older epochs only matter to a slave that has been away for that many promotions.
MAX_ENTRIES = 256


class EpochHistory:
    """``(epoch, start_offset)`` pairs, epochs rising, starts never falling."""

    def __init__(self, entries: Iterable[Sequence[int]] = ()) -> None:
        self._entries: list[tuple[int, int]] = []
        for epoch, start in entries:
            self._append(int(epoch), int(start))

    @property
    def entries(self) -> list[tuple[int, int]]:
        return list(self._entries)

    @property
    def latest(self) -> int:
        """The newest epoch this log holds writes of (0: none yet)."""
        return self._entries[-1][0] if self._entries else 0

    def begin(self, epoch: int, start: int) -> bool:
        """Record that ``epoch``'s writes begin at ``start``; false if it is not newer."""
        if epoch <= self.latest:
            return False
        self._append(epoch, start)
        return True

    def end_of(self, epoch: int, log_end: int) -> int:
        """Where the writes of ``epoch`` (or the newest epoch before it this log knows) end here."""
        for held, start in self._entries:
            if held > epoch:
                return start
        return log_end

    def adopt(self, master: Iterable[Sequence[int]], log_end: int) -> bool:
        """Take the master's history for the bytes held (up to ``log_end``); true if it changed."""
        entries = [(int(e), int(s)) for e, s in master if int(s) <= log_end]
        if entries == self._entries:
            return False
        self._entries = []
        for epoch, start in entries:
            self._append(epoch, start)
        return True

    def cut(self, offset: int) -> None:
        """The log was cut back to ``offset``: epochs that began after it hold nothing here."""
        self._entries = [(e, s) for e, s in self._entries if s <= offset]

    def _append(self, epoch: int, start: int) -> None:
        if self._entries:
            last_epoch, last_start = self._entries[-1]
            if epoch <= last_epoch or start < last_start:
                raise ValueError(
                    f"epoch history: ({epoch}, {start}) does not follow ({last_epoch}, {last_start}): "
                    "epochs must rise and starts must not fall"
                )
        self._entries.append((epoch, start))
        del self._entries[:-MAX_ENTRIES]

    # -- persistence (blocking) ------------------------------------------------------

    @classmethod
    def load(cls, state: StateStore) -> EpochHistory:
        raw = state.get(DB, KEY)
        return cls(unpack(raw) if raw is not None else ())

    def save(self, state: StateStore) -> None:
        state.put(DB, KEY, pack([list(entry) for entry in self._entries]))

    def __repr__(self) -> str:
        return f"EpochHistory({self._entries})"


__all__ = ["EpochHistory"]
