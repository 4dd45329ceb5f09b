"""The dedup window and its lmdb rows against a plain model, through checkpoints, failures,
the memory cap and restarts.

The model is a map of every stored (subject, id) to when it was last stored: a record is a
duplicate while its id was stored on its subject within the window (the same id on another
subject is another message). Whatever the order of appends, failed appends,
checkpoints written or failed (before lmdb, or after it with pruning failing), a memory cap
of 1 to 100 ids, and crashes followed by a restart that loads lmdb and replays the log past
the last checkpoint, ``admit`` (with ``lookup_stored`` where ``to_look_up`` asks) must answer
as the model does.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from delaymq.protocol.records import Message, encode_batch, scan_batch
from delaymq.realtime import dedup as dedup_store
from delaymq.realtime.dedup import DedupWindow, dedup_key, dedup_keys, locate
from delaymq.storage.state import StateStore

WINDOW = 3000
#: Records as (subject, id): every id on two subjects, as two tenants might send it.
RECORDS = [(subject, f"i{n}") for subject in ("a.orders", "b.noise") for n in range(6)]
KEYS = {record: dedup_key(record[1], record[0], 0) for record in RECORDS}
RECORD_OF = {key: record for record, key in KEYS.items()}


def write_checkpoint(store: StateStore, buckets: list[int], batches: list[tuple[list[str], int]], now: int) -> None:
    """A checkpoint's lmdb part: the batches' rows, then pruning."""
    with store.write() as batch:
        for bucket in dedup_store.write_ids(batch, batches):
            if bucket not in buckets:
                buckets.append(bucket)
                buckets.sort()
    dedup_store.prune(store, buckets, now, WINDOW)


def run(folder: Path, seed: int, memory_ids: int) -> None:
    """200 random steps: admit (with lmdb lookups where memory does not cover), append or fail,
    take a checkpoint, write it (or fail before or after lmdb), crash and restart with replay."""
    rng = random.Random(seed)
    store = StateStore.open(folder / "state")
    try:
        now = 10_000
        window = DedupWindow(window_ms=WINDOW, memory_ids=memory_ids, covers_from=now)
        buckets: list[int] = []
        truth: dict[tuple[str, str], int] = {}  # (subject, id) -> stored_at of its latest stored copy
        log: list[tuple[list[str], int]] = []  # indexed batches (ids, stored_at) in order
        durable = 0  # batches covered by the lmdb checkpoint
        inflight: list[tuple[list[str], int]] = []  # (ids, admitted_at)
        checkpoint: tuple[list[tuple[list[str], int]], int] | None = None  # (taken, upto)
        for step in range(200):
            roll = rng.random()
            now += rng.choice([0, 1, 7, 100, 400, 1000, 2500])
            if roll < 0.45:
                records = rng.sample(RECORDS, rng.randint(1, 4))
                if rng.random() < 0.2:
                    records.append(records[0])
                ids = [KEYS[record] for record in records]
                busy = {message_id for appending, _ in inflight for message_id in appending}
                if busy & set(ids):
                    continue
                unsure = window.to_look_up(ids, now)
                stored: set[str] = dedup_store.lookup_stored(store, unsure, now - WINDOW) if unsure else set()
                answered = window.admit(ids, now, stored)
                seen: set[tuple[str, str]] = set()
                expected: list[bool] = []
                for record in records:
                    expected.append(record not in seen and not (record in truth and truth[record] > now - WINDOW))
                    seen.add(record)
                assert answered == expected, (seed, step, ids, answered, expected, truth, now, window.covers_from)
                kept = [message_id for message_id, new in zip(ids, answered) if new]
                if kept:
                    inflight.append((kept, now))
            elif roll < 0.65 and inflight:
                kept, _ = inflight.pop(rng.randrange(len(inflight)))
                if rng.random() < 0.2:
                    window.forget(kept)
                else:
                    window.indexed(kept, now, base=len(log))
                    log.append((kept, now))
                    truth.update(dict.fromkeys(map(RECORD_OF.__getitem__, kept), now))
            elif roll < 0.8 and checkpoint is None:
                checkpoint = (window.take_unpersisted(), len(log))
            elif roll < 0.92 and checkpoint is not None:
                taken, upto = checkpoint
                checkpoint = None
                outcome = rng.random()
                if outcome < 0.6:
                    write_checkpoint(store, buckets, taken, now)
                    durable = upto
                    window.committed(taken, now)
                elif outcome < 0.8:  # lmdb written, prune failed: reported failed
                    write_checkpoint(store, buckets, taken, now)
                    durable = upto
                    window.restore_unpersisted(taken)
                else:
                    window.restore_unpersisted(taken)
            elif roll >= 0.97 and not inflight and checkpoint is None:
                # crash + restart
                window = DedupWindow(window_ms=WINDOW, memory_ids=memory_ids, covers_from=now)
                buckets = dedup_store.load_buckets(store)
                entries, covers = dedup_store.load_recent(store, buckets, now, WINDOW, memory_ids)
                window.load(entries, covers)
                replay = log[durable:]
                log = log[:durable]
                for ids, _ in replay:
                    window.indexed(ids, now, base=len(log))
                    log.append((ids, now))
                    truth.update(dict.fromkeys(map(RECORD_OF.__getitem__, ids), now))
    finally:
        store.close()


@pytest.mark.parametrize("memory_ids", [1, 3, 6, 100])
@pytest.mark.parametrize("seed", range(25))
def test_the_window_answers_as_a_map_of_stored_times(tmp_path: Path, seed: int, memory_ids: int) -> None:
    run(tmp_path, seed, memory_ids)


def test_dedup_keys_are_per_subject_whatever_the_shape_of_the_batch() -> None:
    mixed = scan_batch(encode_batch([Message("x", "a.orders"), Message("x", "b.noise"), Message("y", "a.orders")]))
    keys = dedup_keys(mixed)
    assert keys == [dedup_key("x", "a.orders", 0), dedup_key("x", "b.noise", 0), dedup_key("y", "a.orders", 0)]
    assert len(set(keys)) == 3
    single = scan_batch(encode_batch([Message("x", "a.orders"), Message("y", "a.orders")]))
    assert dedup_keys(single) == [keys[0], keys[2]]  # the one-subject path makes the same keys
    retry = scan_batch(encode_batch([Message("x", "%retry%g%a.orders", attempts=1)]))
    assert dedup_keys(retry) == [dedup_key("x", "%retry%g%a.orders", 1)] and dedup_keys(retry)[0] not in keys
    window = DedupWindow(window_ms=1000, memory_ids=100, covers_from=0)
    assert window.admit(keys[1:2], now=10) == [True]  # x on b.noise first ...
    window.indexed(keys[1:2], 10, base=0)
    assert window.admit(keys, now=11) == [True, False, True]  # ... leaves x on a.orders new
    window.indexed([keys[0], keys[2]], 11, base=100)
    # QUERY by id finds the newest copy, and a retry's key never answers for its id.
    assert locate(window.recent(12), ["x", "y", "z"]) == {"x": (11, 100, 0), "y": (11, 100, 1)}
