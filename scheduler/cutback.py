"""Cutting a schedule folder back to a message-log offset: async replication's divergence.

Under async replication a master files what it wrote at once; replaced before its slaves
had a tail of it, it rejoins holding filed entries its new master never had. Those
entries are the last ones of their hours (an hour's entries are filed in message-log
order: each entry's ``source`` grows), so cutting is: for every hour, drop the entries
whose ``source`` is at or past the offset (the index and the schedule log truncated to
the first of them) and forget them in the dispatch log (rewritten without them, so the
numbers the new master's records reuse are not taken as delivered). The store is closed
meanwhile; opening it again runs its recovery, which finds the hours shorter than their
committed summaries, rebuilds their heads from the index and moves the replay checkpoint
back to the cut (``delaymq.scheduler.recovery``).

Blocking; returns how many entries were cut.
"""

from __future__ import annotations

import os
from pathlib import Path

from delaymq.scheduler.delayindex import CHECKPOINT_KEY, ENTRY_SIZE, REPLAY_DB, read_entry
from delaymq.scheduler.dispatchlog import DispatchLog, read_delivered
from delaymq.scheduler.hours import DISPATCH_SUFFIX, INDEX_SUFFIX, LOG_SUFFIX
from delaymq.storage.state import StateStore


def cut_schedule_folder(folder: Path, offset: int) -> int:
    """Drop every filed entry replayed from message-log ``offset`` on (the store must be closed)."""
    cut = 0
    for index_path in sorted(folder.glob("*" + INDEX_SUFFIX)):
        data = index_path.read_bytes()
        count = len(data) // ENTRY_SIZE
        keep = count
        while keep > 0 and read_entry(data, (keep - 1) * ENTRY_SIZE, keep - 1, str(index_path)).source >= offset:
            keep -= 1
        if keep == count:
            continue
        stem = index_path.name[: -len(INDEX_SUFFIX)]
        log_end = read_entry(data, keep * ENTRY_SIZE, keep, str(index_path)).offset
        _truncate(folder / (stem + LOG_SUFFIX), log_end)
        _truncate(index_path, keep * ENTRY_SIZE)
        dispatch = folder / (stem + DISPATCH_SUFFIX)
        delivered = sorted(entry for entry in read_delivered(dispatch) if entry < keep)
        if dispatch.exists():
            temporary = dispatch.with_name(dispatch.name + ".cut")
            temporary.unlink(missing_ok=True)
            with DispatchLog.open(temporary) as rewritten:
                rewritten.append(delivered)
                rewritten.flush()
            os.replace(temporary, dispatch)
        cut += count - keep
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return cut


def lower_checkpoint(state: StateStore, offset: int) -> None:
    """Replay's checkpoint back to ``offset`` if it is past it.

    Recovery moves it back for hours that lost entries; a cut tail that filed no entry (a
    CANCEL alone) shortens no hour, and a checkpoint left past the log's new end would have
    replay read the next record from the middle of it."""
    stored = state.get(REPLAY_DB, CHECKPOINT_KEY)
    if stored is not None and int.from_bytes(stored, "big") > offset:
        with state.write() as batch:
            batch.put(REPLAY_DB, CHECKPOINT_KEY, offset.to_bytes(8, "big"))


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as file:
        file.truncate(size)
        os.fsync(file.fileno())


__all__ = ["cut_schedule_folder"]
