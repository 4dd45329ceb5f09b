"""Cancel, move and look up scheduled messages, by id or by subject and business key.

The producer's ``cancel``, ``move`` and ``query`` send CANCEL / MOVE / QUERY to the
scheduler groups (route ``delayed-producer``, as SCHEDULE). The sans-IO part is here:

- ``Selection`` checks what a request names (ids, or a subject and a key: exactly
  one) before anything is sent, and cuts a long list of ids into requests of at most
  ``MAX_IDS``;
- ``parse_states`` checks a group's answer, one ``MessageState`` per id;
- ``merge_states`` joins the answers of several groups: a message a group knows
  beats "unknown", and "delivered" beats everything (a message stored by two groups,
  after a retried SCHEDULE whose first answer was lost, was delivered if either
  delivered it);
- ``parse_locations`` checks a realtime group's QUERY answer (``delaymq.realtime.query``)
  and ``with_locations`` adds what the realtime groups said to the scheduler's states:
  ``realtime_group`` and each consumer group's state (``consumer_groups``).

``GroupCalls`` (trio) asks one named group, or every group the metaserver routes
delayed producers to, at once. A try that gets no answer or a "not now" refusal
(``not_master``, ``unavailable``: a failover) is retried on the same group at its
current address with the SCHEDULE backoff until ``send_timeout``; a group that
cannot be asked fails the whole call (``CallTimedOut``), since "unknown" would be a
guess. A read-only (R) scheduler group is not routed to producers, so it is not asked.
``GroupCalls(route=RouteKind.CONSUMER)`` asks every realtime group the same way
(read-only ones too: their consumers still pull from them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import trio

from delaymq.client.messages import check_key
from delaymq.client.routes import (
    CALL_BACKOFF,
    Attempt,
    CallTimedOut,
    NoRouteError,
    RouteClient,
    RouteTable,
)
from delaymq.clock import Clock
from delaymq.net.connection import TransportError
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.peers import AsyncCaller
from delaymq.protocol.backoff import BackoffRun
from delaymq.protocol.cancel import MAX_IDS
from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.errors import LocalProtocolError, PeerError, RemoteProtocolError
from delaymq.protocol.fields import check_name
from delaymq.protocol.routes import RoutedGroup, RouteKind

#: The states each command answers, per id.
STATES: dict[Command, frozenset[str]] = {
    Command.CANCEL: frozenset({"cancelled", "delivered", "unknown"}),
    Command.MOVE: frozenset({"moved", "delivered", "unknown"}),
    Command.QUERY: frozenset({"scheduled", "delivered", "cancelled", "unknown"}),
}

#: Which answer wins when two groups answer for one id (higher wins).
_RANK = {"delivered": 4, "scheduled": 3, "moved": 3, "cancelled": 2, "unknown": 0}

_INT_FIELDS = ("deliver_at", "dispatched_at", "hour")
#: What a realtime group says of a message for each consumer group of its subject.
CONSUMER_STATES = frozenset({"acked", "handed out", "waiting"})
_STR_FIELDS = ("group", "realtime_group")


@dataclass(frozen=True, slots=True)
class MessageState:
    """Where one scheduled message is, as a CANCEL, MOVE or QUERY answered it.

    ``state``: CANCEL "cancelled" | "delivered" | "unknown"; MOVE "moved" |
    "delivered" | "unknown"; QUERY "scheduled" | "delivered" | "cancelled" |
    "unknown". Times are epoch ms (UTC), None when not known: ``deliver_at`` the
    due time (for "moved" the new one), ``dispatched_at`` when a realtime group
    accepted it. ``hour`` is the epoch hour it is filed under, ``group`` the
    scheduler group that answered (None: no group knows the id), ``realtime_group``
    the realtime group that stored it, and ``consumer_groups`` each consumer group
    of its subject there: "acked", "handed out" (not acked yet) or "waiting" (both
    None when no realtime group places it: not delivered yet, or stored longer ago
    than its realtime group remembers; see docs/cancel.md).
    """

    id: str
    state: str
    deliver_at: int | None = None
    dispatched_at: int | None = None
    hour: int | None = None
    group: str | None = None
    realtime_group: str | None = None
    consumer_groups: Mapping[str, str] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields that are known, for JSON."""
        out: dict[str, Any] = {"id": self.id, "state": self.state}
        for name in (*_INT_FIELDS, *_STR_FIELDS):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.consumer_groups is not None:
            out["consumer_groups"] = dict(self.consumer_groups)
        return out


@dataclass(frozen=True, slots=True)
class Location:
    """Where a realtime group holds a message (its QUERY answer for a stored id)."""

    id: str
    group: str  # the realtime group
    subject: str
    offset: int
    consumer_groups: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Selection:
    """What a request names: ``ids`` (deduplicated, in order), or a ``subject`` and ``key``."""

    ids: tuple[str, ...] = ()
    subject: str | None = None
    key: str | None = None

    def requests(self) -> list[dict[str, Any]]:
        """The metadata of each request: one by key, or one per ``MAX_IDS`` ids."""
        if self.key is not None:
            return [{"subject": self.subject, "key": self.key}]
        return [{"ids": list(self.ids[i : i + MAX_IDS])} for i in range(0, len(self.ids), MAX_IDS)]


def select(
    ids: str | Iterable[str] | None = None,
    *,
    subject: str | None = None,
    key: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Selection:
    """A checked ``Selection``: ids (one str or many), or ``subject`` with ``key``; never both.

    ``LocalProtocolError`` names the field that is wrong (nothing is sent then).
    """
    if ids is not None:
        if subject is not None or key is not None:
            raise LocalProtocolError(
                "give ids, or subject and key, not both", code="bad_request", field="key" if key else "subject"
            )
        # A ``SentId`` (a str subclass) goes as the plain str it is.
        listed = [str(ids)] if isinstance(ids, str) else [str(i) if isinstance(i, str) else i for i in ids]
        if not listed:
            raise LocalProtocolError("ids is empty; name at least one message id", code="limit", field="ids", limit=1)
        for index, message_id in enumerate(listed):
            check_name(message_id, f"ids[{index}]", limits.max_id)
        return Selection(ids=tuple(dict.fromkeys(listed)))
    if key is None and subject is None:
        raise LocalProtocolError("name the messages: ids, or subject and key", code="bad_request", field="ids")
    if key is None:
        raise LocalProtocolError("subject is given without key; give both", code="bad_request", field="key")
    if subject is None:
        raise LocalProtocolError("key is given without subject; give both", code="bad_request", field="subject")
    return Selection(subject=check_name(subject, "subject", limits.max_subject), key=check_key(key))


def _result_maps(metadata: Mapping[str, Any], what: str, source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``results[i]``, map) of an answer's ``results`` list; ``RemoteProtocolError`` if it is no list of maps."""
    results = metadata.get("results")
    if not isinstance(results, list):
        raise RemoteProtocolError(
            f"{what} from {source} has no list 'results' (got {results!r:.200})", code="bad_metadata", field="results"
        )
    for index, item in enumerate(results):
        where = f"results[{index}]"
        if not isinstance(item, dict):
            raise RemoteProtocolError(f"{what} {where} from {source} is not a map", code="bad_metadata", field=where)
        yield where, item


def parse_states(command: Command, metadata: Mapping[str, Any], group: str) -> list[MessageState]:
    """A group's answer, checked: one ``MessageState`` per id (``group`` filled in when the answer has none)."""
    allowed = STATES[command]
    name = command_name(command)
    out = []
    for where, item in _result_maps(metadata, f"{name} answer", f"group {group}"):
        message_id, state = item.get("id"), item.get("state")
        if not isinstance(message_id, str) or not message_id or state not in allowed:
            raise RemoteProtocolError(
                f"{name} answer {where} needs a str 'id' and a 'state' of {', '.join(sorted(allowed))}; "
                f"got {item!r:.200}",
                code="bad_metadata",
                field=where,
            )
        values: dict[str, Any] = {}
        for field in _INT_FIELDS:
            value = item.get(field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise RemoteProtocolError(
                    f"{name} answer {where}.{field} is {value!r}, not an int",
                    code="bad_metadata",
                    field=f"{where}.{field}",
                )
            values[field] = value
        for field in _STR_FIELDS:
            value = item.get(field)
            values[field] = value if isinstance(value, str) and value else None
        if state != "unknown" and values["group"] is None:
            values["group"] = group
        out.append(MessageState(message_id, state, **values))
    return out


def merge_states(selection: Selection, answers: Sequence[Sequence[MessageState]]) -> list[MessageState]:
    """One state per id from every group's answer.

    By ids: one per id asked, in the order asked, "unknown" where no group knows it.
    By key: one per id any group named, in the order they first appear. Where two
    groups know an id, "delivered" wins, then "scheduled"/"moved", then "cancelled".
    """
    best: dict[str, MessageState] = {}
    for answer in answers:
        for state in answer:
            held = best.get(state.id)
            if held is None or _RANK[state.state] > _RANK[held.state]:
                best[state.id] = state
    if selection.key is not None:
        return [state for state in best.values() if state.state != "unknown"]
    return [best.get(message_id) or MessageState(message_id, "unknown") for message_id in selection.ids]


def parse_locations(metadata: Mapping[str, Any], group: str) -> list[Location]:
    """A realtime group's QUERY answer, checked: a ``Location`` per id it stored."""
    out = []
    for where, item in _result_maps(metadata, "QUERY answer", f"realtime group {group}"):
        if not isinstance(item.get("id"), str) or not isinstance(item.get("stored"), bool):
            raise RemoteProtocolError(
                f"QUERY answer {where} from realtime group {group} needs a str 'id' and a bool 'stored'; "
                f"got {item!r:.200}",
                code="bad_metadata",
                field=where,
            )
        if not item["stored"]:
            continue
        subject, offset, groups = item.get("subject"), item.get("offset"), item.get("groups")
        if (
            not isinstance(subject, str)
            or not isinstance(offset, int)
            or isinstance(offset, bool)
            or not isinstance(groups, dict)
            or not all(isinstance(name, str) and state in CONSUMER_STATES for name, state in groups.items())
        ):
            raise RemoteProtocolError(
                f"QUERY answer {where} from realtime group {group}: a stored id needs a str 'subject', an int "
                f"'offset' and 'groups' mapping names to {', '.join(sorted(CONSUMER_STATES))}; got {item!r:.200}",
                code="bad_metadata",
                field=where,
            )
        out.append(Location(item["id"], group, subject, offset, dict(groups)))
    return out


def with_locations(states: Sequence[MessageState], locations: Mapping[str, Location]) -> list[MessageState]:
    """``states`` with the realtime groups' word: ``realtime_group`` and ``consumer_groups``.

    A message no scheduler group knows (an immediate one) but a realtime group stored
    is "delivered".
    """
    out = []
    for state in states:
        where = locations.get(state.id)
        if where is None:
            out.append(state)
            continue
        out.append(
            replace(
                state,
                state="delivered" if state.state == "unknown" else state.state,
                realtime_group=where.group,
                consumer_groups=where.consumer_groups,
            )
        )
    return out


# ---------------------------------------------------------------------- trio


@dataclass(slots=True)
class _Outcome:
    states: list[Any] | None = None
    error: BaseException | None = None


def _progress(location: Location) -> int:
    """How far the consumer groups got with a message (to choose between two stored copies)."""
    rank = {"waiting": 0, "handed out": 1, "acked": 2}
    return sum(rank[state] for state in location.consumer_groups.values())


class GroupCalls:
    """CANCEL / MOVE / QUERY to scheduler groups: one named group, or all of the route, retried."""

    def __init__(
        self,
        routes: RouteClient,
        peers: AsyncCaller,
        *,
        clock: Clock,
        timeout: float | None,
        retry_for: float,
        retry_for_name: str = "send_timeout",
        route: RouteKind = RouteKind.DELAYED_PRODUCER,
    ) -> None:
        self.route = route  # DELAYED_PRODUCER: the scheduler groups; CONSUMER: the realtime groups
        self.routes = routes
        self.peers = peers
        self.clock = clock
        self.timeout = timeout  # seconds, per try
        self.retry_for = retry_for  # seconds a call keeps being retried
        self.retry_for_name = retry_for_name

    async def call(
        self, command: Command, selection: Selection, extra: Mapping[str, Any], *, group: str | None = None
    ) -> list[MessageState]:
        """Every request of ``selection`` (with ``extra`` metadata) to ``group`` or every routed group, merged."""
        out: list[MessageState] = []
        for metadata in selection.requests():
            metadata.update(extra)
            part = Selection(ids=tuple(metadata["ids"])) if "ids" in metadata else selection
            out += merge_states(part, await self._ask(command, metadata, group))
        return out

    async def locate(self, ids: Sequence[str]) -> dict[str, Location]:
        """QUERY every group of the route (realtime groups) for ``ids``: where each stored one is.

        An id two groups stored (a re-send after a lost answer) is placed where a
        consumer group got furthest with it.
        """
        found: dict[str, Location] = {}
        for start in range(0, len(ids), MAX_IDS):
            answers = await self._ask(Command.QUERY, {"ids": list(ids[start : start + MAX_IDS])}, None, parse_locations)
            for answer in answers:
                for location in answer:
                    held = found.get(location.id)
                    if held is None or _progress(location) > _progress(held):
                        found[location.id] = location
        return found

    async def _ask(
        self,
        command: Command,
        metadata: dict[str, Any],
        group: str | None,
        parse: Callable[[Mapping[str, Any], str], list[Any]] | None = None,
    ) -> list[list[Any]]:
        deadline = self.clock.monotonic_ms() + round(self.retry_for * 1000)
        if group is not None:
            check_name(group, "group", 255)
            names = [group]
        else:
            answer = await self._route(command, deadline, [])
            names = [routed.group for routed in answer]
            if not names:
                raise self.routes.table.no_route(self._key())
        if parse is None:
            parse = partial(parse_states, command)
        outcomes = [_Outcome() for _ in names]
        async with trio.open_nursery() as nursery:
            for name, outcome in zip(names, outcomes, strict=True):
                nursery.start_soon(self._ask_group, command, metadata, name, deadline, outcome, parse)
        for outcome in outcomes:
            if outcome.error is not None:
                raise outcome.error
        return [outcome.states or [] for outcome in outcomes]

    def _key(self) -> Any:
        return RouteTable.key(self.route)

    async def _route(self, command: Command, deadline: int, tried: list[Attempt]) -> tuple[RoutedGroup, ...]:
        """The route's groups; a route no metaserver has answered yet is waited for until ``deadline``."""
        backoff = BackoffRun(CALL_BACKOFF, random=self.routes.table.random)
        while True:
            try:
                return (await self.routes.groups(self.route)).groups
            except NoRouteError as error:
                tried.append(Attempt("", ", ".join(self.routes.table.meta_addresses), error))
            await self._back_off(command, backoff, deadline, tried)

    async def _ask_group(
        self,
        command: Command,
        metadata: dict[str, Any],
        name: str,
        deadline: int,
        outcome: _Outcome,
        parse: Callable[[Mapping[str, Any], str], list[Any]],
    ) -> None:
        try:
            outcome.states = await self._ask_one(command, metadata, name, deadline, parse)
        except Exception as error:
            outcome.error = error

    async def _ask_one(
        self,
        command: Command,
        metadata: dict[str, Any],
        name: str,
        deadline: int,
        parse: Callable[[Mapping[str, Any], str], list[Any]],
    ) -> list[Any]:
        tried: list[Attempt] = []
        backoff = BackoffRun(CALL_BACKOFF, random=self.routes.table.random)
        while True:
            groups = await self._route(command, deadline, tried)
            member = next((routed for routed in groups if routed.group == name), None)
            if member is None:
                # Not routed now: evicted while down, or failing over; it may come back.
                kind = "scheduler" if self.route is RouteKind.DELAYED_PRODUCER else "realtime"
                tried.append(Attempt(name, "", NoRouteError(f"{kind} group {name} is not in the route now")))
            else:
                now = self.clock.monotonic_ms()
                left = max(0.001, (deadline - now) / 1000)
                timeout = left if self.timeout is None else min(self.timeout, left)
                try:
                    frame = await self.peers.call(member.address, command, metadata, timeout=timeout)
                except (PeerError, TransportError) as error:
                    if not RouteTable.is_retryable(error):
                        raise
                    self.routes.table.failed(self._key(), name, self.clock.monotonic_ms())
                    tried.append(Attempt(name, member.address, error))
                else:
                    return parse(frame.metadata, name)
            await self._back_off(command, backoff, deadline, tried)

    async def _back_off(self, command: Command, backoff: BackoffRun, deadline: int, tried: list[Attempt]) -> None:
        now = self.clock.monotonic_ms()
        wait = backoff.next_delay_ms()
        if now + wait >= deadline:
            detail = "; ".join(str(attempt) for attempt in tried[-3:])
            raise CallTimedOut(
                f"{command_name(command)} gave up after {self.retry_for:g} s ({self.retry_for_name}): "
                f"{len(tried)} failed attempts; last: {detail}",
                tried,
                rounds=backoff.failures,
                elapsed_ms=now - (deadline - round(self.retry_for * 1000)),
            )
        await self.clock.sleep_ms(wait)


__all__ = [
    "CONSUMER_STATES",
    "MAX_IDS",
    "GroupCalls",
    "Location",
    "MessageState",
    "Selection",
    "merge_states",
    "parse_locations",
    "parse_states",
    "select",
    "with_locations",
]
