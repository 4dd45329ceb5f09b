"""Tail: what a master remembers of records appended and not yet filed, no socket needed."""

from delaymq.scheduler.cancels import ScheduledBatch, Tail, TailEntry
from delaymq.scheduler.idindex import CANCELLED, SCHEDULED


def a_batch() -> ScheduledBatch:
    """Records 0, 2 and 3 of a received batch (record 1 was a duplicate), appended at 1,000."""
    starts, ends = [0, 10, 30, 60], [10, 30, 60, 100]
    return ScheduledBatch(
        keys=["a", "c", "d"],
        deliver_ats=[5_000, 7_000, 9_000],
        key_hashes=[None, b"order-7", None],
        kept=[0, 2, 3],
        starts=starts,
        ends=ends,
        offset=1_000,
        end=1_080,
    )


def test_a_scheduled_batch_answers_for_each_key_as_its_own_entry_would():
    tail = Tail()
    tail.add(a_batch(), 1_080)
    # Each key's record at its offset in the log: 10 + 30 + 40 bytes were appended.
    assert tail.unfiled("a", 0) == TailEntry(5_000, 1_000, 1_080, SCHEDULED, None)
    assert tail.unfiled("c", 0) == TailEntry(7_000, 1_010, 1_080, SCHEDULED, b"order-7")
    assert tail.unfiled("d", 999) == TailEntry(9_000, 1_040, 1_080, SCHEDULED, None)
    assert tail.unfiled("b", 0) is None  # the duplicate was not appended
    assert tail.unfiled("a", 1_080) is None  # filed: the index answers now
    assert tail.with_key(b"order-7") == ["c"]
    assert len(tail) == 3


def test_filing_forgets_a_batch_but_not_a_later_record_of_one_of_its_keys():
    tail = Tail()
    tail.add(a_batch(), 1_080)
    tail.add([("c", TailEntry(7_000, 1_080, 1_120, CANCELLED, b"order-7"))], 1_120)
    tail.filed(1_080)
    assert set(tail.ids) == {"c"}  # "a" and "d" filed; "c" was cancelled after
    assert tail.unfiled("c", 1_080) == TailEntry(7_000, 1_080, 1_120, CANCELLED, b"order-7")
    assert tail.with_key(b"order-7") == ["c"]
    tail.filed(1_120)
    assert not tail.ids and not tail.keys


def test_a_lookup_under_way_keeps_a_filed_batch_until_it_ends():
    tail = Tail()
    tail.add(a_batch(), 1_080)
    epoch = tail.begin_lookup()  # began before the filing: must still find the keys here
    tail.filed(1_080)
    assert set(tail.ids) == {"a", "c", "d"} and tail.with_key(b"order-7") == ["c"]
    tail.end_lookup(epoch)
    assert not tail.ids and not tail.keys
