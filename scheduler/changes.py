"""CANCEL, MOVE and QUERY on a scheduler master (docs/cancel.md).

Each id is decided on the event loop with no await between looking and deciding
(the index read in one transaction, its pages warmed by a thread just before), so
a message is either delivered or cancelled, never both. A cancel or move holds the
entries back from firing, appends one record to the write-ahead message log, and
answers once it is durable (and replicated as the policy asks); replay then files
it like a SCHEDULE. The ``Scheduler`` routes these commands to a ``ChangeHandler``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.net.limits import Limits
from delaymq.net.requests import Request
from delaymq.protocol.cancel import Selector, parse_selector
from delaymq.protocol.envelope import HEADER_SIZE
from delaymq.protocol.records import redeliver_at
from delaymq.scheduler.cancels import Hold, RecentDispatches, TailEntry, handed_out, look_up
from delaymq.scheduler.current import CurrentSession
from delaymq.scheduler.hours import HOUR_MS
from delaymq.scheduler.idindex import (
    CANCELLED,
    SCHEDULED,
    IdEntry,
    cancel_record,
    filed_subjects,
    ids_for_key,
    is_displaced,
    key_hash,
    message_id_of,
    move_record,
    record_subject,
)
from delaymq.scheduler.roles import MasterSession
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.storage.errors import StorageError, storage_refusal
from delaymq.storage.threads import RunBlocking

#: Where each key's message is now: ``(state, its value or tail entry, in the dispatch log?)``.
States = dict[str, tuple[str, Any, bool]]


class ChangeHandler:
    """Answers CANCEL, MOVE and QUERY on a master."""

    def __init__(
        self,
        *,
        current: CurrentSession,
        clock: Clock,
        limits: Limits,
        run_blocking: RunBlocking,
        recent: RecentDispatches,
    ) -> None:
        self._current = current
        self._clock = clock
        self._limits = limits
        self._run_blocking = run_blocking
        #: When realtime accepted the latest dispatches (the answers' ``dispatched_at``).
        self._recent = recent

    async def cancel(self, request: Request) -> dict[str, Any]:
        return await self._change(request, "CANCEL")

    async def move(self, request: Request) -> dict[str, Any]:
        return await self._change(request, "MOVE")

    async def query(self, request: Request) -> dict[str, Any]:
        session = self._current.taking_requests("QUERY")
        selector = parse_selector(request.metadata, command="QUERY", limits=self._limits)
        keys = await self._selected(session, selector)
        if selector.key is None:  # by key, ``_selected`` read the pages already
            await self._run_blocking(partial(look_up, self._current.store, keys))  # the pages, for the look below
        states = self._states_now(session, keys)
        while not _carry_key(selector, states):  # an id goes to another message once filed
            await self._next_filing(session, "QUERY")
            keys = await self._selected(session, selector)
            states = self._states_now(session, keys)
        results = []
        for k in keys:
            state, value, _logged = states[k]
            answer: dict[str, Any] = {"id": message_id_of(k), "state": "scheduled" if state == "unfiled" else state}
            if value is not None:
                answer.update(deliver_at=value.deliver_at, hour=value.deliver_at // HOUR_MS, group=self._current.group)
                if state == "delivered" and isinstance(value, IdEntry):
                    at = self._recent.get(value.hour, value.entry)
                    if at is not None:
                        answer["dispatched_at"] = at
            results.append(answer)
        return {"results": results}

    async def _selected(self, session: MasterSession, selector: Selector) -> list[str]:
        """The index keys a request names: its ids, or the ids filed or in the tail with its key."""
        if selector.key is None:
            return list(selector.ids)
        assert selector.subject is not None
        tail = session.tail
        epoch = tail.begin_lookup()
        try:
            found = await self._run_blocking(
                partial(_ids_and_pages, self._current.store, selector.subject, selector.key)
            )
        finally:
            tail.end_lookup(epoch)
        hashed = key_hash(selector.subject, selector.key)
        in_tail = tail.with_key(hashed)
        # A tail entry that moved the key elsewhere (or cancelled it) still names it: its state decides.
        # Retries have keys of their own (not the message's); a displaced message is the subject's.
        keys = [k for k in dict.fromkeys([*found, *in_tail]) if "\x00" not in k or is_displaced(k)]
        # An id under its own key and displaced too: the displaced message is the older one, done
        # before the other was scheduled (or that would have been a duplicate).
        held = {k for k in keys if "\x00" not in k}
        return [k for k in keys if not is_displaced(k) or message_id_of(k) not in held]

    def _states_now(
        self, session: MasterSession, keys: list[str]
    ) -> dict[str, tuple[str, IdEntry | TailEntry | None, bool]]:
        """Where each key's message is now, decided on the event loop (no await; the index
        read in one transaction, its pages in memory from the thread's read just before):
        "unknown", "unfiled" (scheduled, replay has not filed it), "busy" (a cancel or an
        append of it is under way), "cancelled", "delivered" (in the dispatch log, or handed
        to a lane) or "scheduled"."""
        out: dict[str, tuple[str, IdEntry | TailEntry | None, bool]] = {}
        appending, cancelling = session.appending, session.cancelling
        tail, checkpoint = session.tail, self._current.store.checkpoint
        indexed: list[str] = []
        for key in keys:
            if key in appending or key in cancelling:
                out[key] = ("busy", None, False)
                continue
            entry = tail.unfiled(key, checkpoint)
            if entry is not None:
                out[key] = (("cancelled" if entry.state == CANCELLED else "unfiled"), entry, False)
            else:
                indexed.append(key)
        if indexed:
            wheels = self._current.wheels
            for key, (value, logged) in zip(indexed, look_up(self._current.store, indexed)):
                if value is None:
                    out[key] = ("unknown", None, False)
                elif value.state == CANCELLED:
                    out[key] = ("cancelled", value, False)
                elif logged or handed_out(wheels, value.hour, value.entry):
                    out[key] = ("delivered", value, logged)
                else:
                    out[key] = ("scheduled", value, False)
        return out

    async def _change(self, request: Request, command: str) -> dict[str, Any]:
        """CANCEL or MOVE: decide each id on the event loop, hold what is to change back from
        firing, append one record, answer once it is durable (docs/cancel.md)."""
        session = self._current.taking_requests(command)
        move = command == "MOVE"
        selector = parse_selector(
            request.metadata, command=command, limits=self._limits, now_ms=self._clock.now_ms(), move=move
        )
        await session.mastership.confirm()
        keys, states, changing, read = await self._decide(session, selector, command)
        results = self._answers(command, keys, states, selector.deliver_at)
        if not changing:
            return {"results": results}
        assert session.holds is not None
        holds: list[Hold] = []
        for k in changing:
            value = states[k][1]
            assert isinstance(value, IdEntry)
            holds.append(session.holds.hold(value.hour, value.entry))
        if move:
            assert selector.deliver_at is not None
            moved = [redeliver_at(read[k][2], selector.deliver_at) for k in changing]
            data = move_record(moved)
        else:
            data = cancel_record(changing, taken_at=self._clock.now_ms())
        done = session.cancelling.start(changing)
        try:
            with trio.CancelScope(shield=True):  # once handed to the writer it may reach the log
                offset = await self._current.writer.append(data)
        except BaseException as error:
            with trio.CancelScope(shield=True):
                await session.holds.release(holds)  # not in the log: they fire after all
            if isinstance(error, StorageError):
                raise storage_refusal(f"{command}: the message log could not store the record", error) from error
            raise
        finally:
            session.cancelling.end(done)
        session.holds.settle(holds, offset)
        end = offset + len(data)
        if move:
            assert selector.deliver_at is not None
            entries = _moved_entries(changing, states, read, offset, end, selector.deliver_at)
        else:
            entries = _cancelled_entries(changing, states, read, offset, end)
        await self._current.logged(session, entries, end, command)
        return {"results": results}

    async def _decide(
        self, session: MasterSession, selector: Selector, command: str
    ) -> tuple[list[str], States, list[str], dict[str, tuple[int | None, int | None, Any]]]:
        """The keys a CANCEL or MOVE names, where each message is now (decided on the event loop
        with no await after the last look), the keys to change, and what was read of each of
        them: a MOVE's record (to file again), a CANCEL's subject (for the tail, ``Tail``)."""
        move = command == "MOVE"
        keys = await self._selected(session, selector)
        read: dict[str, tuple[int | None, int | None, Any]] = {}  # key -> (hour, entry, record or subject)
        warm = selector.key is not None  # by key, ``_selected`` read the pages already
        while True:
            if not warm:
                await self._run_blocking(partial(look_up, self._current.store, keys))  # the pages, for the look below
            warm = False
            self._current.check_master(session, command)
            states = self._states_now(session, keys)
            if not _carry_key(selector, states):  # an id goes to another message once filed
                await self._next_filing(session, command)
                keys = await self._selected(session, selector)
                warm = True
                continue
            wait = [k for k, (state, _v, _l) in states.items() if state in ("busy", "unfiled")]
            if wait:
                await self._wait_settled(session, states, wait, command)
                continue
            changing = [k for k, (state, _v, _l) in states.items() if state == "scheduled"]
            wanted = [
                k
                for k in changing
                if (move or "\x00" not in k) and read.get(k, (None, None))[:2] != _place(states[k][1])
            ]
            if not wanted:
                return keys, states, changing, read
            places = [_place(states[k][1]) for k in wanted]
            reader = _read_records if move else _subjects
            got: list[Any] = await self._run_blocking(partial(reader, self._current.store, places))
            read.update((k, (hour, entry, item)) for k, (hour, entry), item in zip(wanted, places, got))
            # decide again: nothing may have changed while reading

    async def _wait_settled(
        self, session: MasterSession, states: dict[str, tuple[str, Any, bool]], wait: list[str], command: str
    ) -> None:
        """Wait until an append or cancel of these ids is over, or replay has filed them."""
        k = wait[0]
        event = session.appending.waiting_for((k,)) or session.cancelling.waiting_for((k,))
        if event is not None:
            await event.wait()
            return
        entry = states[k][1]
        assert isinstance(entry, TailEntry)
        session.replay_alarm.poke()
        with trio.move_on_after(self._current.replication_timeout_ms / 1000) as waited:
            while self._current.store.checkpoint < entry.end and self._current.session is session:
                await session.step_filed.wait()
        if waited.cancelled_caught:
            raise storage_refusal(
                f"{command}: id {k!r} is not filed yet (replay is behind); try again",
                StorageError("replay has not reached the record"),
            )

    async def _next_filing(self, session: MasterSession, command: str) -> None:
        """Wait for replay's next step (the keys a request selected are then looked up again)."""
        session.replay_alarm.poke()
        with trio.move_on_after(self._current.replication_timeout_ms / 1000) as waited:
            await session.step_filed.wait()
        if waited.cancelled_caught:
            raise storage_refusal(
                f"{command}: a message of the key is not filed yet (replay is behind); try again",
                StorageError("replay has not reached the record"),
            )

    def _answers(
        self, command: str, keys: list[str], states: dict[str, tuple[str, Any, bool]], moved_to: int | None
    ) -> list[dict[str, Any]]:
        done = "moved" if command == "MOVE" else "cancelled"
        out = []
        for k in keys:
            state, value, _logged = states[k]
            answer: dict[str, Any] = {"id": message_id_of(k)}
            if state == "scheduled":
                answer["state"] = done
            elif state == "cancelled":
                answer["state"] = "cancelled" if command == "CANCEL" else "unknown"
            else:
                answer["state"] = state  # delivered, unknown
            if answer["state"] == "moved":
                answer["deliver_at"] = moved_to
            elif value is not None and answer["state"] != "unknown":
                answer["deliver_at"] = value.deliver_at
            if state == "delivered" and isinstance(value, IdEntry):
                at = self._recent.get(value.hour, value.entry)
                if at is not None:
                    answer["dispatched_at"] = at
            out.append(answer)
        return out


def _carry_key(selector: Selector, states: dict[str, tuple[str, Any, bool]]) -> bool:
    """Whether each message found by subject and key still carries that key: a record filed
    since the keys were selected may have given one of the ids to a message of another
    subject (or another key), which the request must not touch."""
    if selector.key is None:
        return True
    assert selector.subject is not None
    hashed = key_hash(selector.subject, selector.key)
    return all(value is None or value.key_hash == hashed for _state, value, _logged in states.values())


def _ids_and_pages(store: ScheduleStore, subject: str, key: str) -> list[str]:
    """The index keys filed with (``subject``, ``key``), their values and dispatch logs read
    too (in memory for the decision on the event loop): one thread hop, not two."""
    found = ids_for_key(store.state, subject, key)
    look_up(store, found)
    return found


def _read_records(store: ScheduleStore, places: list[Any]) -> list[bytes]:
    return [store.read_record(hour, entry) for hour, entry in places]


def _subjects(store: ScheduleStore, places: list[Any]) -> list[str | None]:
    """The subject of each filed entry (None: its record cannot be read). Blocking."""
    values = [IdEntry(hour * HOUR_MS, entry, 0, SCHEDULED, None) for hour, entry in places]
    return [None if subject is None else subject.decode() for subject in filed_subjects(store.directory, values)]


def _cancelled_entries(
    changing: list[str],
    states: States,
    read: dict[str, tuple[int | None, int | None, Any]],
    offset: int,
    end: int,
) -> list[tuple[str, TailEntry]]:
    """The tail's entries for a CANCEL record at ``offset``: each message cancelled, with its subject if read."""
    entries = []
    for k in changing:
        value = states[k][1]
        assert isinstance(value, IdEntry)
        subject = read[k][2] if k in read else None
        entries.append((k, TailEntry(value.deliver_at, offset, end, CANCELLED, value.key_hash, subject)))
    return entries


def _moved_entries(
    changing: list[str],
    states: States,
    records: dict[str, tuple[int | None, int | None, Any]],
    offset: int,
    end: int,
    deliver_at: int,
) -> list[tuple[str, TailEntry]]:
    """The tail's entries for a MOVE record at ``offset``: each moved message scheduled anew
    under its id (filing files it there, as a new SCHEDULE of it); one moved from a displaced
    key leaves that key cancelled."""
    entries = []
    position = offset + HEADER_SIZE  # the envelope header of the MOVE record
    for k in changing:
        value = states[k][1]
        assert isinstance(value, IdEntry)
        record = records[k][2]
        subject = None if "\x00" in k and not is_displaced(k) else record_subject(record, 0).decode()
        if is_displaced(k):
            entries.append((k, TailEntry(value.deliver_at, offset, end, CANCELLED, value.key_hash)))
        moved = TailEntry(deliver_at, position, end, SCHEDULED, value.key_hash, subject)
        entries.append((message_id_of(k) if is_displaced(k) else k, moved))
        position += len(record)
    return entries


def _place(value: object) -> tuple[int, int] | tuple[None, None]:
    return (value.hour, value.entry) if isinstance(value, IdEntry) else (None, None)


__all__ = ["ChangeHandler"]
