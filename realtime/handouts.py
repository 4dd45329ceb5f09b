"""After a crash: the hand-outs the pull logs recorded since the last checkpoint, made consistent.

The checkpoint holds each share's position and given-back queue and each
consumer's committed pull-log length; a PULL is answered only once its entries
are in the consumer's pull log (the page cache, which outlives a killed
process). So after a crash the pull logs' tails (entries past the committed
length) say exactly what consumers were handed since the checkpoint, while the
checkpoint still shows those messages as new (the share's position behind
them) or given back (in the share's queue). Handing them out from there would
deliver them again as if for the first time.

``reconcile`` keeps the tails as the consumers' hand-outs in flight (they come
back after the ack timeout with their redeliveries + 1, or are acked by a
consumer that retries its acks) and, per share and consume-log sequence, keeps
only the newest hand-out: the one with the most redeliveries, a tail over the
queue over a committed hand-out when equal (each give-back adds one, so a
newer hand-out of a message always has more, or took it from the queue with
the same count). Older ones are settled (marked done) or leave the queue; new
entries a tail holds are passed over by the share (``Share.skip``). Everything
pointing at a consume-log sequence the log no longer holds (records lost to
damage of the message log) is dropped the same way. Sans-IO: fed the loaded
state, it changes it in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from delaymq.realtime.groups import ConsumerState, Share


@dataclass(eq=False, slots=True)
class Member:
    """A consumer being recovered: ``committed`` is the pull-log length the checkpoint holds.

    Its entries ``[committed, length)`` are the tail recorded after the checkpoint.
    """

    consumer: ConsumerState
    committed: int


@dataclass
class Reconciled:
    """What ``reconcile`` changed (shares and consumers to commit) and counts for the log."""

    shares: set[Share] = field(default_factory=set)
    consumers: set[ConsumerState] = field(default_factory=set)
    kept: int = 0  # hand-outs of the tails kept in flight
    superseded: int = 0  # older hand-outs or queue entries a newer hand-out replaced
    dropped: int = 0  # hand-outs and queue entries whose record is gone
    moved_back: int = 0  # shares whose position was past their consume log


# A hand-out's rank among equal redelivery counts: committed < queued < tail.
_COMMITTED, _QUEUED, _TAIL = 0, 1, 2


def reconcile(
    shares: Iterable[Share], members: Iterable[Member], count: Callable[[str], int], new_shares: set[Share]
) -> Reconciled:
    """Make shares and consumers agree with the tails and the consume logs (see the module docstring).

    ``count(subject)`` is the subject's consume-log entry count; ``new_shares``
    were created for tails whose share the checkpoint does not hold yet (their
    position becomes the first new entry their consumers were handed).
    """
    result = Reconciled()
    by_share: dict[Share, list[Member]] = {}
    for member in members:
        by_share.setdefault(member.consumer.share, []).append(member)
    for share in {*shares, *by_share}:
        _reconcile_share(share, by_share.get(share, []), count(share.subject), share in new_shares, result)
    return result


def _reconcile_share(share: Share, members: list[Member], count: int, new: bool, result: Reconciled) -> None:
    if share.position > count:
        share.position = count
        result.moved_back += 1
        result.shares.add(share)
    # The newest hand-out of each sequence: (redeliveries, rank, where) where is a
    # queue index or (consumer, pull-log sequence).
    newest: dict[int, tuple[int, int, int | tuple[ConsumerState, int]]] = {}
    dropped_queue: set[int] = set()

    def settle(where: int | tuple[ConsumerState, int]) -> None:
        if isinstance(where, int):
            dropped_queue.add(where)
            result.shares.add(share)
        else:
            consumer, pulled = where
            consumer.progress.mark(pulled, pulled + 1)
            result.consumers.add(consumer)

    def offer(sequence: int, redeliveries: int, rank: int, where: int | tuple[ConsumerState, int]) -> None:
        if sequence >= count:
            settle(where)
            result.dropped += 1
            return
        held = newest.get(sequence)
        if held is None:
            newest[sequence] = (redeliveries, rank, where)
            return
        result.superseded += 1
        if (redeliveries, rank) > held[:2]:
            settle(held[2])
            newest[sequence] = (redeliveries, rank, where)
        else:
            settle(where)

    for index, (sequence, redeliveries) in enumerate(share.redeliver):
        offer(sequence, redeliveries, _QUEUED, index)
    tail_sequences: set[int] = set()
    first_new: int | None = None
    for member in members:
        consumer = member.consumer
        base = consumer.window_base
        if member.committed < consumer.length:
            result.consumers.add(consumer)  # its longer pull log is committed
        for start, end in consumer.progress.undone(consumer.acked, consumer.length):
            for pulled in range(start, end):
                sequence = consumer.sequences[pulled - base]
                redeliveries = consumer.redeliveries[pulled - base]
                in_tail = pulled >= member.committed
                offer(sequence, redeliveries, _TAIL if in_tail else _COMMITTED, (consumer, pulled))
                if in_tail and sequence < count:
                    tail_sequences.add(sequence)
                    if redeliveries == 0 and (first_new is None or sequence < first_new):
                        first_new = sequence
    if dropped_queue:
        share.redeliver = deque(item for index, item in enumerate(share.redeliver) if index not in dropped_queue)
    if new and first_new is not None:
        share.position = first_new
    skip = {sequence for sequence in share.skip | tail_sequences if share.position <= sequence < count}
    position = share.position
    while position in skip:
        skip.discard(position)
        position += 1
    if position != share.position or skip != share.skip or new:
        share.position = position
        share.skip = skip
        result.shares.add(share)
    result.kept += sum(1 for _redeliveries, rank, _where in newest.values() if rank == _TAIL)


__all__ = ["Member", "Reconciled", "reconcile"]
