"""Start-up: open the data folder and bring the realtime state back.

``open_storage`` opens the data folder's parts (``messages/`` the message log,
``consume/`` the consume logs, ``pull/`` the pull logs, ``state/`` lmdb; see
docs/realtime-storage.md), each checked against the format it was written with.
``recover`` reads the last checkpoint, loads the dedup window's recent ids,
replays the message log past the index checkpoint into the consume logs (which
confirm or rewrite the entries written after it), and rebuilds the shares and
the consumers that still hold unacked hand-outs, the ones their pull logs
recorded after the checkpoint included (``handouts``). Blocking: run in a thread.

Damage to the message log (a segment cut short, deleted or holding a flipped
byte) loses the records from the damage on; the records before it are intact
and still delivered. The segmented log cuts its last segment at the first
record that does not check; ``move_aside_after_gap`` first moves aside the
segments after a hole further back. When the log then ends below the index
checkpoint, ``recover`` cuts the consume logs back to its end, lowers the
checkpoint, drops the hand-outs and given-back entries of lost records, moves
group positions back, commits all of it, and logs one warning naming the lost
offsets, bytes and records.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from delaymq.realtime import dedup as dedup_store
from delaymq.realtime.checkpoint import (
    LoadedState,
    Snapshot,
    consumer_from_record,
    encode_consumer,
    encode_share,
    load_state,
    share_key,
    write_snapshot,
)
from delaymq.realtime.consumelog import CONSUME_FORMAT, ENTRY_SIZE, decode_entry, list_subjects
from delaymq.realtime.dedup import DedupWindow
from delaymq.realtime.groups import ConsumerState, Groups, Share
from delaymq.realtime.handouts import Member, Reconciled, reconcile
from delaymq.realtime.index import Indexer
from delaymq.realtime.pulllog import PULL_FORMAT, PullLog, consumer_stem, list_pull_logs
from delaymq.storage.errors import CorruptLog
from delaymq.storage.folder import DataFolder, fsync_directory
from delaymq.storage.format import ensure_format
from delaymq.storage.log import DEFAULT_SEGMENT_SIZE, SegmentedLog, segment_bases, segment_name
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
class MessageFiles:
    """What the message-log folder held before the log opened: to name what damage lost."""

    disk_end: int  # where its segment files ended (an offset)
    moved_aside: tuple[str, ...] = ()  # the segments after a hole, renamed ``<name>.lost``
    gap_at: int | None = None  # where the segments stopped following each other


def move_aside_after_gap(directory: Path) -> MessageFiles:
    """Rename the segments that follow a missing, short or overlapping one (blocking; before the log opens).

    The segmented log repairs only its last segment and refuses a hole further
    back. The records before the hole are intact: the segments after it are
    renamed ``<name>.lost`` (kept for an operator; the log ignores them), so the
    one before the hole becomes the last, whose torn tail the log cuts.
    """
    if not directory.is_dir():
        return MessageFiles(0)
    segments = [(base, (directory / segment_name(base)).stat().st_size) for base in segment_bases(directory)]
    if not segments:
        return MessageFiles(0)
    disk_end = max(base + size for base, size in segments)
    hole = next((index for index in range(len(segments) - 1) if sum(segments[index]) != segments[index + 1][0]), None)
    if hole is None:
        return MessageFiles(disk_end)
    moved: list[str] = []
    for base, _size in segments[hole + 1 :]:
        name = segment_name(base)
        target = directory / f"{name}.lost"
        copy = 0
        while target.exists():
            copy += 1
            target = directory / f"{name}.lost.{copy}"
        os.rename(directory / name, target)
        moved.append(target.name)
    fsync_directory(directory)
    return MessageFiles(disk_end, tuple(moved), sum(segments[hole]))


@dataclass(frozen=True, slots=True)
class Storage:
    """A realtime data folder's parts, open."""

    message_log: SegmentedLog
    store: StateStore
    consume_folder: DataFolder
    pull_folder: DataFolder
    found: MessageFiles = field(default_factory=lambda: MessageFiles(0))

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
    """Open (or create) the data folder ``root``; what opened is closed again if a part fails (blocking).

    The state store opens first: its lock keeps any other server off the folder
    while a hole in the message log is moved aside.
    """
    root.mkdir(parents=True, exist_ok=True)
    opened: list[Any] = []
    try:
        store = StateStore.open(root / "state", extra_format={"realtime_state": 1})
        opened.append(store)
        found = move_aside_after_gap(root / "messages")
        message_log = SegmentedLog.open(root / "messages", segment_size=segment_size)
        opened.append(message_log)
        consume_folder = open_folder(root / "consume", "consume logs", dict(CONSUME_FORMAT))
        opened.append(consume_folder)
        pull_folder = open_folder(root / "pull", "pull logs", dict(PULL_FORMAT))
        opened.append(pull_folder)
    except BaseException:
        for thing in reversed(opened):
            thing.close()
        raise
    return Storage(message_log, store, consume_folder, pull_folder, found)


def recover(
    *,
    message_log: SegmentedLog,
    store: StateStore,
    consume_dir: Path,
    pull_dir: Path,
    groups: Groups,
    dedup: DedupWindow,
    now: int,
    found: MessageFiles | None = None,
    replay: bool = True,
) -> tuple[Indexer, list[int], list[tuple[ConsumerState, PullLog]]]:
    """Catch the consume logs up with the message log and load the groups (blocking).

    ``found`` is what ``open_storage`` saw of the message log before opening it
    (to name what damage lost). A message log that ends below the index
    checkpoint lost records the state refers to: the consume logs are cut back
    to its end and the checkpoint lowered, and ``handouts.reconcile`` drops what
    pointed past it. Whatever recovery repairs is committed before it returns.
    ``replay=False`` leaves the records past the checkpoint to the caller (a slave
    applies them with their progress records: ``delaymq.realtime.replica``).
    """
    state = load_state(store)
    found = found or MessageFiles(disk_end=message_log.end_offset)
    counts, index_offset, lost_records = _cut_to_log_end(consume_dir, message_log.end_offset, state)
    _load_dedup_ids(store, dedup, state.dedup_buckets, now)
    indexer = Indexer(consume_dir, indexed_offset=index_offset, on_ids=dedup.indexed)
    try:
        _open_consume_logs(
            indexer, message_log, counts, now=now, replay=replay, lowered=index_offset < state.index_offset
        )
        for share in state.shares.values():
            groups.add_share(share)
        members, pull_logs, new_shares = load_members(pull_dir, state.consumers, groups, indexer)
        result = reconcile(groups.shares.values(), members, indexer.count, new_shares)
        damaged = index_offset < state.index_offset or bool(found.moved_aside)
        if damaged or result.shares or result.consumers:
            _commit_repairs(
                indexer,
                dedup,
                [pull_logs[consumer] for consumer in result.consumers],
                result,
                store=store,
                message_log=message_log,
                consume_dir=consume_dir,
                pull_dir=pull_dir,
                dedup_buckets=state.dedup_buckets,
                now=now,
            )
    except BaseException:
        indexer.close()
        raise
    _log_recovery(message_log, found, state.index_offset, lost_records, result, damaged=damaged)
    in_flight = [
        (member.consumer, pull_logs[member.consumer])
        for member in members
        if member.consumer.progress.undone(member.consumer.acked, member.consumer.length)
    ]
    return indexer, state.dedup_buckets, in_flight


def _cut_to_log_end(consume_dir: Path, end: int, state: LoadedState) -> tuple[dict[str, int], int, int | None]:
    """The consume-log counts and index offset to recover from, and how many records
    damage lost (None: none): a message log ending below the checkpoint cuts them back."""
    if end < state.index_offset:
        counts, lost_records = cut_consume_logs(consume_dir, end, state.consume_counts)
        return counts, end, lost_records
    return state.consume_counts, state.index_offset, None


def _load_dedup_ids(store: StateStore, dedup: DedupWindow, dedup_buckets: list[int], now: int) -> None:
    """The dedup window's recent ids, as committed (blocking)."""
    entries, covers_from = dedup_store.load_recent(store, dedup_buckets, now, dedup.window_ms, dedup.memory_ids)
    dedup.load(entries, covers_from)
    dedup.bare_ids_until = dedup_store.bare_ids_until(store, dedup_buckets, now, dedup.window_ms)


def _open_consume_logs(
    indexer: Indexer, message_log: SegmentedLog, counts: dict[str, int], *, now: int, replay: bool, lowered: bool
) -> None:
    """Open the consume logs at their checkpoint ``counts`` and (``replay``) index the message log
    past the checkpoint; ``lowered``: damage cut them back, and their new counts must be committed."""
    index_offset = indexer.indexed_offset
    indexer.open_existing(counts)
    replayed = indexer.replay(message_log, now) if replay else 0
    if replayed:
        log.info(
            "realtime: indexed %d record(s) of the message log past the checkpoint at %d",
            replayed,
            index_offset,
        )
    if lowered:
        indexer.dirty.update(indexer.logs.values())


def _commit_repairs(
    indexer: Indexer,
    dedup: DedupWindow,
    pull_logs: list[PullLog],
    result: Reconciled,
    *,
    store: StateStore,
    message_log: SegmentedLog,
    consume_dir: Path,
    pull_dir: Path,
    dedup_buckets: list[int],
    now: int,
) -> None:
    """Commit what recovery repaired: the consume-log counts, and the shares and consumers
    ``reconcile`` changed with their ``pull_logs`` (blocking)."""
    snapshot = Snapshot(
        index_offset=indexer.indexed_offset,
        consume=[(consume_log, consume_log.count) for consume_log in indexer.take_dirty()],
        pull_logs=pull_logs,
        dedup_ids=dedup.take_unpersisted(),
        shares=[(share, encode_share(share)) for share in result.shares],
        consumers=[(consumer, encode_consumer(consumer)) for consumer in result.consumers],
        now=now,
    )
    write_snapshot(
        snapshot,
        store=store,
        message_log=message_log,
        consume_dir=consume_dir,
        pull_dir=pull_dir,
        dedup_buckets=dedup_buckets,
        window_ms=dedup.window_ms,
    )
    dedup.committed(snapshot.dedup_ids, now)


def _log_recovery(
    message_log: SegmentedLog,
    found: MessageFiles,
    checkpoint: int,
    lost_records: int | None,
    result: Reconciled,
    *,
    damaged: bool,
) -> None:
    """What recovery repaired and kept, for an operator."""
    if damaged:
        _log_damage(message_log, found, checkpoint, lost_records, result)
    elif result.moved_back or result.dropped:
        log.warning(
            "realtime: %d group position(s) were past their consume logs and %d hand-out(s) or "
            "given-back entries pointed past them; moved back and dropped",
            result.moved_back,
            result.dropped,
        )
    if result.kept:
        log.info(
            "realtime: kept %d hand-out(s) made after the last checkpoint (from the pull logs); "
            "they come back after the ack timeout with attempts raised, unless acked",
            result.kept,
        )


def recover_storage(
    storage: Storage, *, groups: Groups, dedup: DedupWindow, now: int, replay: bool = True
) -> tuple[Indexer, list[int], list[tuple[ConsumerState, PullLog]]]:
    """``recover`` over an open data folder (blocking)."""
    return recover(
        message_log=storage.message_log,
        store=storage.store,
        consume_dir=storage.consume_folder.path,
        pull_dir=storage.pull_folder.path,
        groups=groups,
        dedup=dedup,
        now=now,
        found=storage.found,
        replay=replay,
    )


def load_members(
    pull_dir: Path, records: dict[bytes, dict[str, Any]], groups: Groups, indexer: Indexer
) -> tuple[list[Member], dict[ConsumerState, PullLog], set[Share]]:
    """The consumers recovery must look at: those the checkpoint holds with hand-outs in
    flight, and any whose pull log holds entries past its committed length (blocking).

    Returns them, their pull logs, and the shares created for tails of groups the
    checkpoint does not hold yet.
    """
    members: list[Member] = []
    pull_logs: dict[ConsumerState, PullLog] = {}
    new_shares: set[Share] = set()

    def share_for(subject: str, group: str, broadcast_consumer: str | None) -> Share:
        key = share_key(subject, group, broadcast_consumer)
        share = groups.shares.get(key)
        if share is None:
            share = groups.add_share(Share(key, subject, group, broadcast_consumer, indexer.count(subject)))
            new_shares.add(share)
        return share

    def add(consumer: ConsumerState, pull_log: PullLog, committed: int, tail: tuple[list[int], list[int]]) -> None:
        consumer.sequences.extend(tail[0])
        consumer.redeliveries.extend(tail[1])
        consumer.length += len(tail[0])
        members.append(Member(consumer, committed))
        pull_logs[consumer] = pull_log

    on_disk = set(list_pull_logs(pull_dir))
    for key, record in records.items():
        pull_log = PullLog(pull_dir, key.hex())
        tail = pull_log.read_tail(record["length"]) if key.hex() in on_disk else ([], [])
        if record["acked"] >= record["length"] and not tail[0]:
            continue  # holds nothing: loaded if it comes back
        sequences, redeliveries = pull_log.read(record["acked"], record["length"])
        broadcast_consumer = record["consumer"] if record["broadcast"] else None
        share = share_for(record["subject"], record["group"], broadcast_consumer)
        add(consumer_from_record(key, record, share, sequences, redeliveries), pull_log, record["length"], tail)
    for stem in sorted(on_disk - {key.hex() for key in records}):
        pull_log = PullLog(pull_dir, stem)
        tail = pull_log.read_tail(0)
        if not tail[0]:
            continue
        names = pull_log.read_names()
        if names is None or consumer_stem(names["subject"], names["group"], names["consumer"]) != stem:
            log.warning(
                "realtime: pull log %s holds %d hand-out(s) of a consumer created after the last "
                "checkpoint but its names file is unreadable: they are handed out again",
                pull_log.path,
                len(tail[0]),
            )
            continue
        subject, group, name = names["subject"], names["group"], names["consumer"]
        broadcast = names.get("broadcast")
        if not isinstance(broadcast, bool):  # written before the names held it
            broadcast = share_key(subject, group, name) in groups.shares
        share = share_for(subject, group, name if broadcast else None)
        pull_log.created = True  # the commit fsyncs its names file and folder
        add(ConsumerState(bytes.fromhex(stem), subject, group, name, share), pull_log, 0, tail)
    return members, pull_logs, new_shares


def cut_consume_logs(consume_dir: Path, end: int, counts: dict[str, int]) -> tuple[dict[str, int], int]:
    """Cut every consume log back to the records below ``end``; returns the new counts and
    how many entries held records past it (blocking)."""
    kept_counts = dict(counts)
    lost = 0
    for stem in list_subjects(consume_dir):
        kept, cut = cut_to_offset(consume_dir / f"{stem}.log", end, counts.get(stem, 0))
        kept_counts[stem] = kept
        lost += cut
    return kept_counts, lost


def cut_to_offset(path: Path, end_offset: int, checkpoint_count: int) -> tuple[int, int]:
    """Cut a consume log to the entries whose records end at or below ``end_offset``.

    For a message log that lost its records from ``end_offset`` on (blocking;
    start-up). Entries below ``checkpoint_count`` were fsynced and are trusted
    (their offsets grow, so the cut is found by bisection); past it the file may
    hold entries indexed after the checkpoint. The file is fsynced. Returns
    ``(kept, lost)``: entries kept, and entries cut that held a record (the
    unconfirmed ones up to the first that does not check).
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        on_disk = os.fstat(fd).st_size // ENTRY_SIZE
        trusted = min(checkpoint_count, on_disk)

        def ends_by(sequence: int) -> bool:
            entry = decode_entry(os.pread(fd, ENTRY_SIZE, sequence * ENTRY_SIZE))
            if entry is None:
                raise CorruptLog(f"consume log {path}: fsynced entry {sequence} does not check")
            return entry.offset + entry.size <= end_offset

        low, high = 0, trusted
        while low < high:
            middle = (low + high) // 2
            if ends_by(middle):
                low = middle + 1
            else:
                high = middle
        kept = low
        lost = trusted - kept
        if on_disk > trusted:
            data = os.pread(fd, (on_disk - trusted) * ENTRY_SIZE, trusted * ENTRY_SIZE)
            for position in range(0, len(data), ENTRY_SIZE):
                if decode_entry(data, position) is None:
                    break
                lost += 1
        if os.fstat(fd).st_size != kept * ENTRY_SIZE:
            os.ftruncate(fd, kept * ENTRY_SIZE)
            os.fsync(fd)
    finally:
        os.close(fd)
    return kept, lost


def _log_damage(
    message_log: SegmentedLog, found: MessageFiles, checkpoint: int, lost_records: int | None, result: Reconciled
) -> None:
    """The one warning that names what the message log lost and what recovery did about it."""
    end = message_log.end_offset
    lost_to = max(found.disk_end, checkpoint)
    records = f"{lost_records} record(s)" if lost_records is not None else "records past the checkpoint, not counted"
    moved = (
        f"; the segments after a hole at offset {found.gap_at} were moved aside as {', '.join(found.moved_aside)}"
        if found.moved_aside
        else ""
    )
    log.warning(
        "realtime: message log %s lost offsets [%d, %d) (%d bytes, %s) to damage%s. Serving from its last "
        "intact record (end %d, index checkpoint %d -> %d): %d group position(s) moved back, "
        "%d hand-out(s) or given-back entries of lost records dropped",
        message_log.directory,
        end,
        lost_to,
        lost_to - end,
        records,
        moved,
        end,
        checkpoint,
        min(checkpoint, end),
        result.moved_back,
        result.dropped,
    )


__all__ = [
    "MessageFiles",
    "cut_to_offset",
    "Storage",
    "load_members",
    "move_aside_after_gap",
    "open_folder",
    "open_storage",
    "recover",
    "recover_storage",
]
