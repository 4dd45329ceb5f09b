"""QUERY on a realtime server: did this group store a message, and where is it for each consumer group.

Request ``{"ids": [str, ...]}`` (1 to ``MAX_IDS``, checked as CANCEL's and the
scheduler's QUERY are: ``delaymq.protocol.cancel``); a realtime server does not
index business keys, so ``subject`` + ``key`` is refused naming ``subject``. Answer
``{"results": [{"id", "stored", "stored_at"?, "offset"?, "subject"?, "groups"}]}``,
one per id asked, in order:

- ``stored``: False when the id is not within this server's query window: the
  batches its dedup window still places (``dedup.locate`` over ``DedupWindow.recent``:
  the newest ``dedup_memory_ids`` ids within ``dedup_window_ms``, indexed by this master
  since it became master, its start-up replay of the log tail included). Older messages,
  and those stored before a restart or a failover, answer unknown here.
- ``offset``: the record's message-log offset; ``subject`` its subject;
  ``stored_at`` when it was indexed (epoch ms).
- ``groups``: each consumer group that reads the subject (has pulled it at least
  once), ``"acked"`` (done with it: acked, or nacked into a retry or dead letter,
  which are records of their own, or passed over by its tag filter), ``"handed
  out"`` (taken by a consumer, not acked yet) or ``"waiting"`` (not taken yet, or
  given back to be handed out again). A broadcast group answers the least done
  of its consumers.

Only an id's first delivery is looked up (not a group's retry of it); an id stored on
several subjects (each its own message) answers its newest copy. A slave
refuses QUERY with ``not_master`` as it refuses PULL. The reads (the window's keys, the records, and
a binary search of the subject's consume log by offset) run through
``run_blocking``; the group states are read on the event loop, with no await
between reading them and answering.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from delaymq.net.limits import Limits
from delaymq.net.requests import Request
from delaymq.protocol.cancel import parse_selector
from delaymq.protocol.envelope import iter_spans
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.records import scan_batch
from delaymq.realtime.consumelog import ConsumeLog
from delaymq.realtime.dedup import locate
from delaymq.realtime.groups import ConsumerState, Groups, Share
from delaymq.realtime.index import REPLAY_LIMITS
from delaymq.storage.errors import StorageError
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import RunBlocking

if TYPE_CHECKING:
    from delaymq.realtime.master import RealtimeMaster
    from delaymq.realtime.roles import Member

ACKED, HANDED_OUT, WAITING = "acked", "handed out", "waiting"
_DONE_RANK = {WAITING: 0, HANDED_OUT: 1, ACKED: 2}

#: Where a located record is: (message-log offset, subject).
Place = tuple[int, str]


class Serving(Protocol):
    """What ``serve_query`` and ``clearfence.serve_clear_fence`` need of
    ``delaymq.realtime.server.RealtimeServer`` (which imports both)."""

    group: str
    member: Member

    async def _serve(
        self,
        what: str,
        handler: Callable[[RealtimeMaster], Callable[[Request], Awaitable[Any]]],
        request: Request,
        *,
        replicated: bool = True,
    ) -> Any: ...


async def serve_query(server: Serving, request: Request) -> dict[str, Any]:
    """QUERY, served as PULL is: by the master only (a slave answers ``not_master``)."""
    member = server.member
    answer: dict[str, Any] = await server._serve(
        "QUERY",
        lambda master: partial(answer_query, master, run_blocking=member.run_blocking, limits=member.limits),
        request,
        replicated=False,
    )
    return answer


async def answer_query(
    master: RealtimeMaster, request: Request, *, run_blocking: RunBlocking, limits: Limits
) -> dict[str, Any]:
    """The answer to one QUERY (see the module docstring)."""
    selector = parse_selector(request.metadata, command="QUERY", limits=limits)
    if selector.key is not None:
        raise RemoteProtocolError(
            "QUERY: a realtime server finds messages by ids only (business keys are the scheduler's)",
            code="bad_request",
            field="subject",
        )
    ids = selector.ids
    now = master._clock.now_ms()
    located = await run_blocking(partial(locate, master._dedup.recent(now), ids))
    places: dict[str, Place] = await run_blocking(partial(read_places, master._log, located))
    searches: list[tuple[ConsumeLog, int]] = []
    for offset, subject in places.values():
        consume_log = master._indexer.consume_log(subject)
        if consume_log is not None:
            searches.append((consume_log, offset))
    found = await run_blocking(partial(find_sequences, searches, [log.count for log, _ in searches]))
    sequences = dict(zip(((log.subject, offset) for log, offset in searches), found, strict=True))
    groups = master._groups
    results: list[dict[str, Any]] = []
    for message_id in ids:
        place = places.get(message_id)
        if place is None:
            results.append({"id": message_id, "stored": False, "groups": {}})
            continue
        offset, subject = place
        sequence = sequences.get((subject, offset))
        results.append(
            {
                "id": message_id,
                "stored": True,
                "stored_at": located[message_id][0],
                "offset": offset,
                "subject": subject,
                "groups": group_states(groups, subject, sequence) if sequence is not None else {},
            }
        )
    return {"results": results}


# ------------------------------------------------------------ blocking reads


def read_places(message_log: SegmentedLog, located: Mapping[str, tuple[int, int, int]]) -> dict[str, Place]:
    """``id -> (offset, subject)`` of each located record whose id the log confirms (blocking).

    A record gone from the log (segments deleted, a tail cut under replication) or
    holding another id now is left out: not stored, as far as QUERY can tell.
    """
    places: dict[str, Place] = {}
    by_batch: dict[int, list[tuple[int, str]]] = {}
    for message_id, (_stored_at, base, index) in located.items():
        by_batch.setdefault(base, []).append((index, message_id))
    for base, wanted in by_batch.items():
        wanted.sort()
        try:
            for (_index, message_id), (offset, record) in zip(wanted, _records_at(message_log, base, wanted)):
                batch = scan_batch(record, REPLAY_LIMITS)
                if batch.ids[0] == message_id and not batch.attempts[0]:
                    places[message_id] = (offset, batch.subjects[0])
        except (StorageError, RemoteProtocolError, ValueError):
            continue
    return places


def _records_at(message_log: SegmentedLog, base: int, wanted: list[tuple[int, str]]) -> Iterable[tuple[int, bytes]]:
    """``(offset, record)`` of the ``index``-th records from ``base`` named in ``wanted`` (ascending)."""
    offset, seen = base, 0
    targets = iter(index for index, _ in wanted)
    target = next(targets, None)
    while target is not None:
        data, next_offset = message_log.read_raw(offset)
        if not data:
            return
        for span in iter_spans(data):
            if seen == target:
                yield offset + span.start, bytes(data[span.start : span.end])
                target = next(targets, None)
                if target is None:
                    return
            seen += 1
        offset = next_offset


def find_sequences(searches: list[tuple[ConsumeLog, int]], counts: list[int]) -> list[int | None]:
    """The consume-log sequence of each (log, message-log offset), by binary search (blocking)."""
    out: list[int | None] = []
    for (consume_log, offset), count in zip(searches, counts, strict=True):
        low, high = 0, count
        try:
            while low < high:
                middle = (low + high) // 2
                if consume_log.entry(middle).offset < offset:
                    low = middle + 1
                else:
                    high = middle
            out.append(low if low < count and consume_log.entry(low).offset == offset else None)
        except (IndexError, StorageError, OSError):
            out.append(None)
    return out


# ------------------------------------------------------------ sans-IO


def group_states(groups: Groups, subject: str, sequence: int) -> dict[str, str]:
    """Each consumer group of ``subject``: where consume-log entry ``sequence`` is for it."""
    by_share: dict[bytes, list[ConsumerState]] = {}
    for consumer in groups.consumers.values():
        if consumer.subject == subject:
            by_share.setdefault(consumer.share.key, []).append(consumer)
    states: dict[str, str] = {}
    for share in groups.shares.values():
        if share.subject != subject:
            continue
        state = share_state(share, by_share.get(share.key, []), sequence)
        held = states.get(share.group)
        if held is None or _DONE_RANK[state] < _DONE_RANK[held]:  # broadcast: the least done consumer
            states[share.group] = state
    return dict(sorted(states.items()))


def share_state(share: Share, consumers: Iterable[ConsumerState], sequence: int) -> str:
    """``sequence`` for one share: given back or not reached (waiting), held by a consumer
    without an ack (handed out), or else done (acked)."""
    if any(given == sequence for given, _redeliveries in share.redeliver):
        return WAITING
    for consumer in consumers:
        sequences, base = consumer.sequences, consumer.window_base
        index = -1
        while True:
            try:
                index = sequences.index(sequence, index + 1)
            except ValueError:
                break
            pulled = base + index
            if consumer.progress.undone(pulled, pulled + 1):
                return HANDED_OUT
    if sequence < share.position or sequence in share.skip:
        return ACKED
    return WAITING


__all__ = ["ACKED", "HANDED_OUT", "WAITING", "answer_query", "group_states", "serve_query", "share_state"]
