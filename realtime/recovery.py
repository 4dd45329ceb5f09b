"""Start-up: open the data folder and bring the realtime state back.

``open_storage`` opens the data folder's parts (``messages/`` the message log,
``consume/`` the consume logs, ``pull/`` the pull logs, ``state/`` lmdb; see
docs/realtime-storage.md), each checked against the format it was written with.
``recover`` reads the last checkpoint, loads the dedup window's recent ids,
replays the message log past the index checkpoint into the consume logs (which
confirm or rewrite the entries written after it), and rebuilds the shares and
the consumers that still hold unacked hand-outs. Blocking: run in a thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from delaymq.realtime import dedup as dedup_store
from delaymq.realtime.checkpoint import consumer_from_record, load_state, share_key
from delaymq.realtime.consumelog import CONSUME_FORMAT
from delaymq.realtime.dedup import DedupWindow
from delaymq.realtime.groups import ConsumerState, Groups, Share
from delaymq.realtime.index import Indexer
from delaymq.realtime.pulllog import PULL_FORMAT, PullLog
from delaymq.storage.errors import CorruptLog
from delaymq.storage.folder import DataFolder
from delaymq.storage.format import ensure_format
from delaymq.storage.log import DEFAULT_SEGMENT_SIZE, SegmentedLog
from delaymq.storage.state import StateStore

log = logging.getLogger(__name__)


def open_folder(path: Path, what: str, params: dict[str, Any]) -> DataFolder:
    """A locked data folder whose FORMAT file matches ``params`` (written on first use)."""
    folder = DataFolder(path, what=what)
    try:
        has_data = any(entry.name not in ("FORMAT", "FORMAT.tmp") for entry in path.iterdir())
        ensure_format(path, params, has_data=has_data)
    except BaseException:
        folder.close()
        raise
    return folder


@dataclass(frozen=True, slots=True)
class Storage:
    """A realtime data folder's parts, open."""

    message_log: SegmentedLog
    store: StateStore
    consume_folder: DataFolder
    pull_folder: DataFolder

    def close(self, indexer: Indexer | None = None) -> None:
        """Close every part (the indexer's consume logs first), each whatever the others do (blocking)."""
        try:
            if indexer is not None:
                indexer.close()
        finally:
            try:
                self.message_log.close()
            finally:
                self.store.close()
                self.consume_folder.close()
                self.pull_folder.close()


def open_storage(root: Path, *, segment_size: int = DEFAULT_SEGMENT_SIZE) -> Storage:
    """Open (or create) the data folder ``root``; what opened is closed again if a part fails (blocking)."""
    root.mkdir(parents=True, exist_ok=True)
    opened: list[Any] = []
    try:
        opened.append(SegmentedLog.open(root / "messages", segment_size=segment_size))
        opened.append(StateStore.open(root / "state", extra_format={"realtime_state": 1}))
        opened.append(open_folder(root / "consume", "consume logs", dict(CONSUME_FORMAT)))
        opened.append(open_folder(root / "pull", "pull logs", dict(PULL_FORMAT)))
    except BaseException:
        for thing in reversed(opened):
            thing.close()
        raise
    return Storage(*opened)


def recover(
    *,
    message_log: SegmentedLog,
    store: StateStore,
    consume_dir: Path,
    pull_dir: Path,
    groups: Groups,
    dedup: DedupWindow,
    now: int,
) -> tuple[Indexer, list[int], list[tuple[ConsumerState, PullLog]]]:
    """Catch the consume logs up with the message log and load the groups (blocking)."""
    state = load_state(store)
    if state.index_offset > message_log.end_offset:
        raise CorruptLog(
            f"message log {message_log.directory} ends at offset {message_log.end_offset}, before "
            f"the index checkpoint at {state.index_offset}: records the state refers to are gone"
        )
    entries, covers_from = dedup_store.load_recent(
        store, state.dedup_buckets, now, dedup.window_ms, dedup.memory_ids
    )
    dedup.load(entries, covers_from)
    indexer = Indexer(consume_dir, indexed_offset=state.index_offset, on_ids=dedup.indexed)
    try:
        indexer.open_existing(state.consume_counts)
        replayed = indexer.replay(message_log, now)
    except BaseException:
        indexer.close()
        raise
    if replayed:
        log.info(
            "realtime: indexed %d record(s) of the message log past the checkpoint at %d",
            replayed,
            state.index_offset,
        )
    for share in state.shares.values():
        count = indexer.count(share.subject)
        if share.position > count:
            log.warning(
                "realtime: share of group %r on %r was at %d past the consume log's %d entries",
                share.group,
                share.subject,
                share.position,
                count,
            )
            share.position = count
        groups.add_share(share)
    in_flight: list[tuple[ConsumerState, PullLog]] = []
    for key, record in state.consumers.items():
        if record["acked"] >= record["length"]:
            continue  # holds nothing: loaded if it comes back
        pull_log = PullLog(pull_dir, key.hex())
        pull_log.truncate(record["length"])
        sequences, redeliveries = pull_log.read(record["acked"], record["length"])
        broadcast_consumer = record["consumer"] if record["broadcast"] else None
        key_of_share = share_key(record["subject"], record["group"], broadcast_consumer)
        share = groups.shares.get(key_of_share)
        if share is None:  # not committed with it (cannot happen), so start it at the end
            position = indexer.count(record["subject"])
            share = groups.add_share(Share(key_of_share, record["subject"], record["group"], broadcast_consumer, position))
        consumer = consumer_from_record(key, record, share, sequences, redeliveries)
        in_flight.append((consumer, pull_log))
    return indexer, state.dedup_buckets, in_flight


__all__ = ["Storage", "open_folder", "open_storage", "recover"]
