"""The sans-IO parts: entry layouts, ack ranges, redelivery decisions by time, dedup, requests."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaymq.net.limits import Limits
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.ranges import AckRanges
from delaymq.realtime import dedup as dedup_store
from delaymq.realtime.consumelog import (
    ENTRY_SIZE,
    HELD,
    TAIL_ENTRIES,
    ConsumeLog,
    decode_entry,
    encode_entry,
    iter_entries,
    list_subjects,
)
from delaymq.realtime.dedup import DedupWindow, locate
from delaymq.realtime.delivery import EntriesNotHeld, pick
from delaymq.realtime.groups import ConsumerState, Groups, Share, UnknownPull
from delaymq.realtime.index import MAX_AHEAD_MS, RELEASE_TICK_MS, Indexer
from delaymq.realtime.pulllog import (
    PULL_ENTRY_SIZE,
    PullLog,
    decode_pull_entries,
    encode_pull_entries,
)
from delaymq.realtime.requests import parse_ack, parse_heartbeat, parse_pull
from delaymq.storage.errors import CorruptLog
from delaymq.storage.state import StateStore

# ----------------------------------------------------------------- consume log


def test_consume_entry_layout_is_fixed_and_checked() -> None:
    entry = encode_entry(0x0102030405060708, 300, 1 << 63 | 5, 1_700_000_000_123)
    assert len(entry) == ENTRY_SIZE == 32
    assert entry[:8] == bytes.fromhex("0102030405060708")
    assert struct.unpack(">I", entry[8:12]) == (300,)
    assert struct.unpack(">Q", entry[12:20]) == (1 << 63 | 5,)
    assert struct.unpack(">q", entry[20:28]) == (1_700_000_000_123,)
    assert struct.unpack(">I", entry[28:]) == (zlib.crc32(entry[:28]),)
    assert decode_entry(entry) == (0x0102030405060708, 300, 1 << 63 | 5, 1_700_000_000_123)
    assert decode_entry(entry[:5] + b"\0" + entry[6:]) is None


@pytest.mark.parametrize("at_once", [False, True])
def test_consume_log_is_an_array_of_entries(tmp_path: Path, at_once: bool) -> None:
    log = ConsumeLog.open(tmp_path, "orders")
    entries = [(n * 100, 100, n, 7) for n in range(5)]
    if at_once:
        log.add_many(entries)
    else:
        for entry in entries:
            log.add(*entry)
    log.write_pending()
    assert log.count == 5
    data = (tmp_path / f"{log.path.stem}.log").read_bytes()
    assert data[3 * ENTRY_SIZE : 4 * ENTRY_SIZE] == encode_entry(300, 100, 3, 7)
    assert log.entry(3).offset == 300
    assert log.read(4, 10) == encode_entry(400, 100, 4, 7)
    log.close()
    assert list_subjects(tmp_path) == {log.path.stem: "orders"}


@pytest.mark.parametrize("at_once", [False, True])
def test_consume_log_recovery_keeps_matching_entries_and_rewrites_the_rest(tmp_path: Path, at_once: bool) -> None:
    log = ConsumeLog.open(tmp_path, "orders")
    for n in range(6):
        log.add(n * 100, 100, 0, 1000 + n)
    log.write_pending()
    log.close()
    path = log.path
    # Entry 4 is garbled and half of entry 5 is lost; the checkpoint had 2.
    data = bytearray(path.read_bytes())
    data[4 * ENTRY_SIZE + 1] ^= 0xFF
    path.write_bytes(bytes(data[: 5 * ENTRY_SIZE + 10]))
    log = ConsumeLog.open(tmp_path, "orders", checkpoint_count=2)
    assert log.count == 2
    replayed = [(n * 100, 100, 0, 2000 + n) for n in range(2, 6)]  # replay from the checkpoint
    if at_once:
        log.add_many(replayed)
    else:
        for entry in replayed:
            log.add(*entry)
    log.finish_recovery()
    stamps = [log.entry(n).stored_at for n in range(6)]
    assert stamps == [1000, 1001, 1002, 1003, 2004, 2005]  # confirmed entries keep their time
    log.close()


def test_consume_log_recovery_cuts_entries_replay_does_not_confirm(tmp_path: Path) -> None:
    log = ConsumeLog.open(tmp_path, "orders")
    for n in range(4):
        log.add(n * 100, 100, 0, 0)
    log.write_pending()
    log.close()
    log = ConsumeLog.open(tmp_path, "orders", checkpoint_count=1)
    log.add(100, 100, 0, 0)
    log.finish_recovery()
    assert log.count == 2 and log.path.stat().st_size == 2 * ENTRY_SIZE
    log.close()
    with pytest.raises(CorruptLog, match="checkpoint says 3"):
        ConsumeLog.open(tmp_path, "orders", checkpoint_count=3)


def test_pick_hands_out_given_back_entries_first_within_the_limits(tmp_path: Path) -> None:
    log = ConsumeLog.open(tmp_path, "orders")
    for n in range(10):
        log.add(n * 100, 100, 0b01 if n % 2 else 0b10, 0)
    log.write_pending()
    groups, share = make_groups()
    share.redeliver.extend([(3, 1), (5, 2)])
    picked, more, _ = pick(log, groups, share, limit=4, max_bytes=10_000, mask=0, now_ms=0)
    assert [(seq, red) for seq, red, _, _ in picked] == [(3, 1), (5, 2), (0, 0), (1, 0)]
    assert share.position == 2 and not more
    picked, *_ = pick(log, groups, share, limit=100, max_bytes=250, mask=0, now_ms=0)
    assert [seq for seq, *_ in picked] == [2, 3]  # 2 x 100 bytes fit in 250
    picked, *_ = pick(log, groups, share, limit=100, max_bytes=1, mask=0, now_ms=0)
    assert [seq for seq, *_ in picked] == [4]  # always one, even over max_bytes
    picked, *_ = pick(log, groups, share, limit=100, max_bytes=10_000, mask=0b01, now_ms=0)
    assert [seq for seq, *_ in picked] == [5, 7, 9]  # 6 and 8 skipped by the bitmask
    assert share.position == 10
    assert pick(log, groups, share, limit=1, max_bytes=1, mask=0, now_ms=0) == ([], False, None)
    log.close()


def test_pick_never_hands_out_an_entry_before_its_time_nor_any_behind_it(tmp_path: Path) -> None:
    log = ConsumeLog.open(tmp_path, "orders")
    # Held entries (sent ahead, out of order), and one indexed at 5,000 by a wall clock that
    # has stepped back since: not held, its time is only when it was indexed.
    times = [HELD | 1_000, HELD | 1_000, HELD | 1_050, 5_000, HELD | 900]
    for n, at in enumerate(times):
        log.add(n * 100, 100, 0b01 if n != 2 else 0b10, at)
    log.write_pending()
    groups, share = make_groups()
    assert pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=999) == ([], False, 1_000)
    assert share.position == 0
    picked, more, held_until = pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=1_000)
    assert [seq for seq, *_ in picked] == [0, 1] and held_until == 1_050 and not more
    # Entry 4 (time 900) waits behind entry 2 (1,050): the subject's order holds.
    assert pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=1_049) == ([], False, 1_050)
    # A tag filter passes over an entry it would not hand out, due or not.
    picked, _, held_until = pick(log, groups, share, limit=10, max_bytes=10_000, mask=0b01, now_ms=1_030)
    assert [seq for seq, *_ in picked] == [3, 4] and held_until is None and share.position == 5
    # A given-back entry (handed out ahead to a consumer that fetched it so) waits for its time too.
    share.redeliver.append((0, 1))
    assert pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=999) == ([], False, 1_000)
    picked, *_ = pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=1_000)
    assert [(seq, red) for seq, red, _, _ in picked] == [(0, 1)]
    log.close()


def test_indexing_holds_only_scheduled_records_that_came_ahead_and_not_too_far(tmp_path: Path) -> None:
    """The entry of a scheduled record that came ahead is flagged with its tick; an immediate
    one (release 0), one already due, and one further ahead than any SEND may bring (an
    older server's, replayed) keep the time they were indexed at: handed out at once."""
    stored_at = 1_000_001
    releases = [stored_at + 1_001, 0, stored_at - 5, stored_at + MAX_AHEAD_MS + 1, stored_at + MAX_AHEAD_MS]
    indexer = Indexer(tmp_path, indexed_offset=0)
    items = [("orders", n * 100, 100, 0, release) for n, release in enumerate(releases)]
    indexer.submit(0, 500, items, [f"m{n}" for n in range(len(items))], stored_at)
    consume_log = indexer.consume_log("orders")
    assert consume_log is not None
    times = [entry[3] for entry in iter_entries(consume_log.read_held(0, 5) or b"")]
    tick = -(-(stored_at + 1_001) // RELEASE_TICK_MS) * RELEASE_TICK_MS
    last = -(-(stored_at + MAX_AHEAD_MS) // RELEASE_TICK_MS) * RELEASE_TICK_MS
    assert times == [HELD | tick, stored_at, stored_at, stored_at, HELD | last]
    indexer.close()


def test_pick_reads_no_file_and_names_the_entries_it_needs_read_first(tmp_path: Path) -> None:
    log = ConsumeLog.open(tmp_path, "orders")
    for n in range(TAIL_ENTRIES * 4):
        log.add(n * 100, 100, 0, 0)
        if n % 100 == 99:
            log.write_pending()
    log.write_pending()
    groups, share = make_groups()
    share.redeliver.append((5, 1))
    with pytest.raises(EntriesNotHeld) as missing:  # entry 5 fell out of the tail
        pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=0)
    assert missing.value.sequence == 5 and list(share.redeliver) == [(5, 1)]  # nothing lost
    log.hold_window(0, log.read(0, TAIL_ENTRIES), log.generation)  # as PULL does, in a worker thread
    picked, *_ = pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=0)
    assert [(seq, red) for seq, red, _, _ in picked] == [(5, 1), *((n, 0) for n in range(9))]
    lagging = log.count - 2 * TAIL_ENTRIES - 1  # past the window, before the tail (at most twice that)
    share.position = lagging
    with pytest.raises(EntriesNotHeld) as missing:
        pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=0)
    assert missing.value.sequence == lagging and share.position == lagging
    share.position = log.count - 3  # in the tail
    picked, *_ = pick(log, groups, share, limit=10, max_bytes=10_000, mask=0, now_ms=0)
    assert [entry[2] for entry in picked] == [n * 100 for n in range(log.count - 3, log.count)]
    log.take_back(log.count - 1)  # an index step taken back: what memory held is forgotten
    stale = log.generation - 1
    log.hold_window(0, log.read(0, 10), stale)  # a read from before it is not held
    assert log.read_held(0, 10) is None
    log.close()


# ----------------------------------------------------------------- pull log


def test_pull_log_entries_round_trip_and_are_checked(tmp_path: Path) -> None:
    data = encode_pull_entries([5, 9, 2**40], [0, 3, 65535])
    assert len(data) == 3 * PULL_ENTRY_SIZE
    assert decode_pull_entries(data) == ([5, 9, 2**40], [0, 3, 65535])
    with pytest.raises(ValueError, match="entry 1"):
        decode_pull_entries(data[:17] + b"\xee" + data[18:])
    log = PullLog(tmp_path, "ab" * 16)
    log.create("orders", "g", "c")
    log.write(0, data)
    log.write(3, encode_pull_entries([11], [1]))
    assert log.read(1, 4) == ([9, 2**40, 11], [3, 65535, 1])
    log.truncate(2)
    assert log.path.stat().st_size == 2 * PULL_ENTRY_SIZE


def test_ack_ranges_merge_out_of_order_acks() -> None:
    ranges = AckRanges()
    ranges.mark(5, 7)
    ranges.mark(2, 3)
    assert (ranges.acked, ranges.ranges()) == (0, [(2, 3), (5, 7)])
    ranges.mark(3, 5)  # touching both: one range
    assert ranges.ranges() == [(2, 7)]
    ranges.mark(0, 2)
    assert (ranges.acked, ranges.ranges()) == (7, [])
    ranges.mark(1, 4)  # a repeat below the acked position changes nothing
    assert ranges.acked == 7
    ranges.mark(9, 10)
    assert ranges.undone(6, 12) == [(7, 9), (10, 12)]
    assert ranges.is_done(9) and not ranges.is_done(8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 8)), max_size=30))
def test_ack_ranges_match_a_set_model(marks: list[tuple[int, int]]) -> None:
    ranges = AckRanges()
    done: set[int] = set()
    for start, length in marks:
        ranges.mark(start, start + length)
        done.update(range(start, start + length))
    acked = 0
    while acked in done:
        acked += 1
    assert ranges.acked == acked
    assert all(ranges.is_done(n) == (n in done) for n in range(60))
    assert [n for start, end in ranges.undone(0, 60) for n in range(start, end)] == [
        n for n in range(60) if n not in done
    ]
    spans = ranges.ranges()
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


# ----------------------------------------------------------------- groups


def make_groups(ack: int = 60_000, consumer: int = 30_000) -> tuple[Groups, Share]:
    groups = Groups(ack_timeout_ms=ack, consumer_timeout_ms=consumer)
    share = groups.add_share(Share(b"s" * 16, "orders", "g", None, 0))
    return groups, share


def make_consumer(groups: Groups, share: Share, name: str, now: int) -> ConsumerState:
    return groups.add_consumer(ConsumerState(name.encode().ljust(16, b"."), "orders", "g", name, share), now)


def test_unacked_hand_outs_go_back_after_the_ack_timeout() -> None:
    groups, share = make_groups(ack=10_000, consumer=1_000_000)
    consumer = make_consumer(groups, share, "c", 0)
    assert groups.record_pull(consumer, [0, 1, 2], [0, 0, 0], now=0) == 0
    assert groups.record_pull(consumer, [3], [2], now=4_000) == 3
    groups.ack(consumer, 1, 2)
    assert groups.next_deadline() == 10_000
    assert groups.expire(9_999) == []
    assert groups.expire(10_000) == [share]
    assert list(share.redeliver) == [(0, 1), (2, 1)]
    assert consumer.acked == 3  # given back counts as done for the consumer
    assert groups.next_deadline() == 14_000
    groups.expire(14_000)
    assert list(share.redeliver)[-1] == (3, 3)
    assert groups.redelivered == 3
    # Taking them hands them out before anything new.
    assert groups.take_redeliveries(share, 2) == [(0, 1), (2, 1)]


def test_a_silent_consumer_loses_its_hand_outs_a_waiting_one_does_not() -> None:
    groups, share = make_groups(ack=60_000, consumer=30_000)
    silent = make_consumer(groups, share, "silent", 0)
    polling = make_consumer(groups, share, "polling", 0)
    groups.record_pull(silent, [0, 1], [0, 0], now=0)
    groups.record_pull(polling, [2], [0], now=0)
    polling.waiting = 1  # parked in a long poll
    assert groups.next_deadline() == 30_000
    assert groups.expire(30_000) == [share]
    assert [s for s, _ in share.redeliver] == [0, 1]
    assert list(groups.live) == [polling.key]  # kept alive by its poll
    assert not silent.live
    groups.touch(silent, 35_000)  # it comes back: alive again, nothing to give back
    assert groups.expire(40_000) == []
    assert groups.expire(60_000) == [share]  # the polling one's ack timeout still applies
    assert [s for s, _ in share.redeliver] == [0, 1, 2]


def test_acking_what_was_never_handed_out_is_refused_and_changes_nothing() -> None:
    groups, share = make_groups()
    consumer = make_consumer(groups, share, "c", 0)
    groups.record_pull(consumer, [7, 8], [0, 0], now=0)
    with pytest.raises(UnknownPull) as error:
        groups.ack(consumer, 1, 3, "consumer 'c'")
    assert (error.value.code, error.value.field, error.value.limit) == ("unknown_pull", "end", 2)
    assert "[1, 3)" in str(error.value) and "[0, 2)" in str(error.value)
    assert consumer.acked == 0 and consumer.progress.ranges() == []
    with pytest.raises(UnknownPull):
        groups.ack(None, 0, 1)
    with pytest.raises(RemoteProtocolError) as empty:
        groups.ack(consumer, 1, 1)
    assert empty.value.code == "bad_value"


def test_nack_gives_back_at_once_and_only_the_unacked() -> None:
    groups, share = make_groups()
    consumer = make_consumer(groups, share, "c", 0)
    groups.record_pull(consumer, [4, 5, 6], [0, 1, 0], now=0)
    groups.ack(consumer, 0, 1)
    acked, woken = groups.nack(consumer, 0, 3, now=5)
    assert (acked, woken) == (3, [share])
    assert list(share.redeliver) == [(5, 2), (6, 1)]
    assert groups.expire(60_000) == []  # nothing left to time out


def test_forget_idle_drops_only_gone_committed_empty_consumers() -> None:
    groups, share = make_groups(consumer=1000)
    gone = make_consumer(groups, share, "gone", 0)
    busy = make_consumer(groups, share, "busy", 0)
    groups.record_pull(busy, [1], [0], now=0)
    groups.expire(1000)  # both silent: gone has nothing, busy's hand-out goes back
    assert groups.forget_idle() == [gone.key]  # busy is dirty: not committed yet
    assert set(groups.consumers) == {busy.key}
    groups.take_dirty()  # a checkpoint took (and wrote) it
    assert groups.forget_idle() == [busy.key]


# ----------------------------------------------------------------- dedup


def test_dedup_window_admits_once_and_forgets_failed_appends() -> None:
    window = DedupWindow(window_ms=1000, memory_ids=100, covers_from=0)
    assert window.to_look_up(["a"], now=500) == ["a"]  # memory does not cover [-500, 500] yet
    assert window.admit(["a", "b", "a"], now=1000) == [True, True, False]
    assert window.admit(["a"], now=1001) == [False]  # pending counts
    window.forget(["b"])
    assert window.admit(["b"], now=1002) == [True]
    window.indexed(["a", "b"], 1002)
    window.committed(window.take_unpersisted(), now=1002)
    assert window.admit(["a"], now=2001) == [False]
    assert window.admit(["a"], now=2002) == [True]  # the window has passed
    assert window.admit(["c"], now=3000, stored=["c"]) == [False]  # lmdb said so


def test_dedup_memory_cap_moves_coverage_forward() -> None:
    window = DedupWindow(window_ms=10_000, memory_ids=3, covers_from=0)
    for n in range(5):
        window.admit([f"id{n}"], now=10_000 + n)
        window.indexed([f"id{n}"], 10_000 + n)
    window.committed(window.take_unpersisted(), now=10_005)
    assert len(window) == 3
    assert window.covers_from == 10_002  # id0 and id1 were evicted
    assert window.to_look_up(["id0", "id4"], now=15_000) == ["id0"]
    assert window.to_look_up(["id0"], now=20_002) == []  # memory covers the window again


def test_dedup_batches_leave_memory_in_order_and_only_once_committed() -> None:
    window = DedupWindow(window_ms=1000, memory_ids=2, covers_from=0)
    for n, ids in enumerate((["a", "b"], ["c"], ["d"])):
        assert window.admit(ids, now=10 + n) == [True] * len(ids)
        window.indexed(ids, 10 + n, base=100 * n)
    first = window.take_unpersisted()
    assert first == [(["a", "b"], 10), (["c"], 11), (["d"], 12)]
    window.restore_unpersisted(first)  # the checkpoint failed: nothing may leave memory
    window.evict(now=5000)
    assert len(window) == 4
    assert locate(window.recent(12), ["c", "z"]) == {"c": (11, 100, 0)}
    window.committed(window.take_unpersisted(), now=13)
    assert len(window) == 2  # over the cap: the oldest batch went, whole
    assert window.covers_from == 11
    assert window.admit(["c", "e"], now=14) == [False, True]
    window.indexed(["e"], 14)
    window.committed(window.take_unpersisted(), now=1011)  # c expired; d and e are the newest two
    assert (len(window), window.covers_from) == (2, 11)  # c left as expired, not for the cap
    assert window.admit(["d", "e", "c"], now=1011) == [False, False, True]


@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from("abcdefgh"), max_size=4), st.integers(0, 700), st.booleans()),
        max_size=30,
    )
)
def test_dedup_window_answers_as_a_plain_map_of_stored_times(steps: list[tuple[list[str], int, bool]]) -> None:
    """Whatever the batches, repeats and failed appends, memory answers what a map of every
    stored id's newest time answers (while it holds the whole window)."""
    window = DedupWindow(window_ms=1000, memory_ids=1000, covers_from=0)
    model: dict[str, int] = {}
    now = 0
    for ids, step, appended in steps:
        now += step
        expected = []
        seen: set[str] = set()
        for message_id in ids:
            new = message_id not in seen and not (message_id in model and model[message_id] > now - 1000)
            seen.add(message_id)
            expected.append(new)
        assert window.admit(ids, now) == expected
        kept = [message_id for message_id, new in zip(ids, expected) if new]
        if appended:
            window.indexed(kept, now)
            model.update(dict.fromkeys(kept, now))
            window.committed(window.take_unpersisted(), now)
        else:
            window.forget(kept)


def test_dedup_rows_of_both_forms_load_and_prune(tmp_path: Path) -> None:
    """A checkpoint writes one ``dedup_time`` row a batch; rows of one id each, as earlier
    versions wrote them, are still loaded and pruned."""
    store = StateStore.open(tmp_path / "state")
    try:
        with store.write() as batch:
            buckets = dedup_store.write_ids(batch, [(["m1", "m2"], 1500), (["m3"], 2100)])
            batch.put(dedup_store.IDS_DB, b"old", struct.pack(">q", 1700))
            batch.put(dedup_store.TIME_DB, struct.pack(">Q", 1) + b"old", b"")
            batch.put(dedup_store.BUCKETS_DB, struct.pack(">Q", 1), b"")
        assert buckets == {1, 2}
        loaded = dedup_store.load_buckets(store)
        entries, covers = dedup_store.load_recent(store, loaded, now=2500, window_ms=10_000, memory_ids=100)
        assert entries == [("m1", 1500), ("m2", 1500), ("old", 1700), ("m3", 2100)]
        assert covers == dedup_store.EVERYTHING
        assert dedup_store.lookup_stored(store, ["m2", "old", "nope"], since=0) == {"m2", "old"}
        assert dedup_store.prune(store, loaded, now=12_001, window_ms=10_000) == 3  # bucket 1: m1, m2, old
        assert loaded == [2]
        assert dedup_store.lookup_stored(store, ["m1", "m2", "old", "m3"], since=0) == {"m3"}
        assert store.items(dedup_store.TIME_DB, struct.pack(">Q", 1)) == []
    finally:
        store.close()


def test_bare_id_rows_are_looked_for_only_while_the_window_may_hold_them(tmp_path: Path) -> None:
    """Rows keyed by a bare message id (a first delivery before keys held the subject) are older
    than any other: the window's oldest bucket says whether SENDs look ids up bare for a window."""
    store = StateStore.open(tmp_path / "state")
    new_key = dedup_store.dedup_key("n1", "orders", 0)
    retry_key = dedup_store.dedup_key("old", "%retry%g%orders", 1)
    try:
        with store.write() as batch:
            dedup_store.write_ids(batch, [(["old", "old-2"], 1500), ([new_key, retry_key], 2500)])
        buckets = dedup_store.load_buckets(store)
        assert dedup_store.bare_ids_until(store, buckets, now=3000, window_ms=10_000) == 13_000
        # Once the window passed the bare rows (pruned or not), nothing is looked up bare.
        assert dedup_store.bare_ids_until(store, buckets, now=12_000, window_ms=10_000) == dedup_store.EVERYTHING
        assert dedup_store.bare_ids_until(store, [], now=3000, window_ms=10_000) == dedup_store.EVERYTHING
        entries, covers = dedup_store.load_recent(store, buckets, now=3000, window_ms=10_000, memory_ids=100)
        window = DedupWindow(window_ms=10_000, memory_ids=100, covers_from=0)
        window.load(entries, covers)
        keys = [dedup_store.dedup_key("old", "orders", 0), dedup_store.dedup_key("old", "other", 0), retry_key]
        # Memory holds them: the first deliveries of "old" on any subject; a retry's key is not bare.
        assert window.stored_bare([*keys, new_key], now=3000) == (set(keys[:2]), {})
        assert window.stored_bare(keys, now=11_500) == (set(), {})  # out of the window
        # Memory short of the window: lmdb settles them.
        short = DedupWindow(window_ms=10_000, memory_ids=1, covers_from=2000)
        assert short.stored_bare(keys, now=3000) == (set(), {"old": keys[:2]})
        assert dedup_store.lookup_stored(store, ["old", "gone"], since=3000 - 10_000) == {"old"}
    finally:
        store.close()


def test_batches_replayed_with_one_time_and_one_first_id_keep_their_own_rows(tmp_path: Path) -> None:
    """A replay stamps a whole step with one time, and an id stored again past its window can
    start two of its batches: neither batch's row may hide the other's ids (from loading,
    which would let memory take one again, or from pruning, which would keep it forever)."""
    store = StateStore.open(tmp_path / "state")
    try:
        with store.write() as batch:
            dedup_store.write_ids(batch, [(["x", "a"], 100_000), (["x", "b"], 100_000)])
        buckets = dedup_store.load_buckets(store)
        entries, _covers = dedup_store.load_recent(store, buckets, now=100_001, window_ms=10_000, memory_ids=100)
        assert sorted(message_id for message_id, _ in entries) == ["a", "b", "x", "x"]
        dedup_store.prune(store, buckets, now=200_000, window_ms=10_000)
        assert dedup_store.lookup_stored(store, ["a", "b", "x"], since=0) == set()
    finally:
        store.close()


# ----------------------------------------------------------------- requests


LIMITS = Limits()


def test_pull_request_defaults_and_refusals() -> None:
    pull = parse_pull({"group": "g", "consumer": "c", "subject": "s", "max": 5}, LIMITS)
    assert (pull.timeout_ms, pull.broadcast, pull.earliest, pull.tags) == (30_000, False, False, ())
    assert pull.max_bytes == LIMITS.max_frame - 64 * 1024
    base = {"group": "g", "consumer": "c", "subject": "s", "max": 5}
    refusals = [
        ({**base, "maxx": 1}, ("bad_request", "maxx", None)),
        ({**base, "max": 10_001}, ("limit", "max", 10_000)),
        ({**base, "max": "5"}, ("bad_value", "max", None)),
        ({**base, "timeout_ms": 300_001}, ("limit", "timeout_ms", 300_000)),
        ({**base, "subject": "x" * 256}, ("limit", "subject", 255)),
        ({**base, "group": ""}, ("limit", "group", 255)),
        ({**base, "consumer": "a\nb"}, ("bad_value", "consumer", None)),
        ({**base, "tags": "red"}, ("bad_value", "tags", None)),
        ({**base, "tags": ["x" * 65]}, ("limit", "tag", 64)),
        ({**base, "from": "start"}, ("bad_value", "from", None)),
        ({**base, "broadcast": 1}, ("bad_value", "broadcast", None)),
        ({k: v for k, v in base.items() if k != "group"}, ("bad_request", "group", None)),
    ]
    for metadata, expected in refusals:
        with pytest.raises(RemoteProtocolError) as error:
            parse_pull(metadata, LIMITS)
        assert (error.value.code, error.value.field, error.value.limit) == expected, metadata


def test_ack_and_heartbeat_requests() -> None:
    base = {"group": "g", "consumer": "c", "subject": "s", "start": 2, "end": 4}
    assert parse_ack(base, LIMITS).end == 4
    assert parse_ack({**base, "delay_ms": 5000}, LIMITS, nack=True).delay_ms == 5000
    for metadata, expected in [
        ({**base, "delay_ms": 5}, ("bad_request", "delay_ms")),  # only NACK takes a delay
        ({**base, "end": 2}, ("bad_value", "end")),
        ({**base, "start": -1}, ("limit", "start")),
    ]:
        with pytest.raises(RemoteProtocolError) as error:
            parse_ack(metadata, LIMITS)
        assert (error.value.code, error.value.field) == expected
    assert parse_heartbeat({"group": "g", "consumer": "c", "subjects": ["a", "b"]}, LIMITS).subjects == ("a", "b")
    with pytest.raises(RemoteProtocolError) as error:
        parse_heartbeat({"group": "g", "consumer": "c"}, LIMITS)
    assert error.value.field == "subjects"


def test_a_consume_log_closes_only_after_a_worker_threads_read_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master stepping down closes its consume logs while a NACK's or a lagging PULL's read
    may still run in a worker thread: the close waits for it, so the read never uses a closed
    descriptor number (which another open could have been given meanwhile)."""
    import threading

    import delaymq.realtime.consumelog as consumelog

    log = ConsumeLog.open(tmp_path, "orders")
    for n in range(5):
        log.add(n * 100, 100, n, 7)
    log.write_pending()
    inside, release = threading.Event(), threading.Event()
    real_pread = os.pread

    def slow_pread(fd: int, length: int, offset: int) -> bytes:
        inside.set()
        assert release.wait(30)
        return real_pread(fd, length, offset)

    monkeypatch.setattr(consumelog.os, "pread", slow_pread)
    closed: list[int] = []
    real_close = os.close
    monkeypatch.setattr(consumelog.os, "close", lambda fd: (closed.append(fd), real_close(fd)))

    class WatchedLock:
        """The log's lock, telling when the closing thread asks for it."""

        def __init__(self, lock: threading.Lock) -> None:
            self.lock, self.close_waits = lock, threading.Event()

        def __enter__(self) -> None:
            if threading.current_thread().name == "closer":
                self.close_waits.set()
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    watched = WatchedLock(log._in_use)
    log._in_use = watched  # type: ignore[assignment]
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(log.read(1, 2)))
    reader.start()
    assert inside.wait(30)  # the read is in its pread
    closer = threading.Thread(target=log.close, name="closer")
    closer.start()
    assert watched.close_waits.wait(30)  # the close asks for the descriptor ...
    assert closed == []  # ... and has not closed it under the read
    release.set()
    reader.join(30)
    closer.join(30)
    assert got == [encode_entry(100, 100, 1, 7) + encode_entry(200, 100, 2, 7)]
    assert len(closed) == 1 and not closer.is_alive()
