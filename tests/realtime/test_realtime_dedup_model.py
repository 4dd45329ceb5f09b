"""The dedup window and its lmdb rows against a plain model, through checkpoints, failures,
the memory cap and restarts.

The model is a map of every stored id to when it was last stored: a record is a duplicate
while its id was stored within the window. Whatever the order of appends, failed appends,
checkpoints written or failed (before lmdb, or after it with pruning failing), a memory cap
of 1 to 100 ids, and crashes followed by a restart that loads lmdb and replays the log past
the last checkpoint, ``admit`` (with ``lookup_stored`` where ``to_look_up`` asks) must answer
as the model does. (From a reviewer's check of the batch-wise window, 2026-11-23.)
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest

from delaymq.realtime import dedup as ds
from delaymq.realtime.dedup import DedupWindow
from delaymq.storage.state import StateStore

WINDOW = 3000
IDS = [f"i{n}" for n in range(12)]


def write_checkpoint(store: StateStore, buckets: list[int], batches: list[tuple[list[str], int]], now: int) -> None:
    """A checkpoint's lmdb part: the batches' rows, then pruning."""
    with store.write() as batch:
        for bucket in ds.write_ids(batch, batches):
            if bucket not in buckets:
                buckets.append(bucket)
                buckets.sort()
    ds.prune(store, buckets, now, WINDOW)


def run(seed: int, memory_ids: int) -> None:
    """200 random steps: admit (with lmdb lookups where memory does not cover), append or fail,
    take a checkpoint, write it (or fail before or after lmdb), crash and restart with replay."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore.open(Path(tmp) / "s")
        try:
            now = 10_000
            w = DedupWindow(window_ms=WINDOW, memory_ids=memory_ids, covers_from=now)
            buckets: list[int] = []
            truth: dict[str, int] = {}  # id -> stored_at of its latest stored copy
            log: list[tuple[list[str], int]] = []  # indexed batches (ids, stored_at) in order
            durable = 0  # batches covered by the lmdb checkpoint
            inflight: list[tuple[list[str], int]] = []  # (ids, admitted_at)
            ckpt: tuple[list[tuple[list[str], int]], int] | None = None  # (taken, upto)
            for step in range(200):
                op = rng.random()
                now += rng.choice([0, 1, 7, 100, 400, 1000, 2500])
                if op < 0.45:
                    ids = rng.sample(IDS, rng.randint(1, 4))
                    if rng.random() < 0.2:
                        ids.append(ids[0])
                    busy = {i for b, _ in inflight for i in b}
                    if busy & set(ids):
                        continue
                    unsure = w.to_look_up(ids, now)
                    stored: set[str] = ds.lookup_stored(store, unsure, now - WINDOW) if unsure else set()
                    got = w.admit(ids, now, stored)
                    seen: set[str] = set()
                    exp: list[bool] = []
                    for i in ids:
                        exp.append(i not in seen and not (i in truth and truth[i] > now - WINDOW))
                        seen.add(i)
                    assert got == exp, (seed, step, ids, got, exp, truth, now, w.covers_from)
                    kept = [i for i, g in zip(ids, got) if g]
                    if kept:
                        inflight.append((kept, now))
                elif op < 0.65 and inflight:
                    kept, _ = inflight.pop(rng.randrange(len(inflight)))
                    if rng.random() < 0.2:
                        w.forget(kept)
                    else:
                        w.indexed(kept, now, base=len(log))
                        log.append((kept, now))
                        truth.update(dict.fromkeys(kept, now))
                elif op < 0.8 and ckpt is None:
                    ckpt = (w.take_unpersisted(), len(log))
                elif op < 0.92 and ckpt is not None:
                    taken, upto = ckpt
                    ckpt = None
                    r = rng.random()
                    if r < 0.6:
                        write_checkpoint(store, buckets, taken, now)
                        durable = upto
                        w.committed(taken, now)
                    elif r < 0.8:  # lmdb written, prune failed: reported failed
                        write_checkpoint(store, buckets, taken, now)
                        durable = upto
                        w.restore_unpersisted(taken)
                    else:
                        w.restore_unpersisted(taken)
                elif op >= 0.97 and not inflight and ckpt is None:
                    # crash + restart
                    w = DedupWindow(window_ms=WINDOW, memory_ids=memory_ids, covers_from=now)
                    buckets = ds.load_buckets(store)
                    entries, cov = ds.load_recent(store, buckets, now, WINDOW, memory_ids)
                    w.load(entries, cov)
                    replay = log[durable:]
                    log = log[:durable]
                    for ids, _ in replay:
                        w.indexed(ids, now, base=len(log))
                        log.append((ids, now))
                        truth.update(dict.fromkeys(ids, now))
        finally:
            store.close()


@pytest.mark.parametrize("memory_ids", [1, 3, 6, 100])
@pytest.mark.parametrize("seed", range(25))
def test_the_window_answers_as_a_map_of_stored_times(seed: int, memory_ids: int) -> None:
    run(seed, memory_ids)
