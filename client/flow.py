"""What a consumer lets through and how much it takes: the exact tag check, the flow caps, the limit.

The server filters by a 64-bit mask, which lets through tags that share a bit,
so ``TagFilter`` makes the exact check here (a message whose tags do not match
is acked silently and never shown). ``FlowControl`` counts the messages and
bytes held (pulled, not yet acked or nacked); pulls stop while either cap is
reached. ``PullLimit`` caps what a consumer pulls over its whole life.
"""

from __future__ import annotations

from collections.abc import Iterable

from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.fields import check_int, check_name


class TagFilter:
    """The exact any-of tag check (the server's bitmask only narrows)."""

    __slots__ = ("tags", "wire")

    def __init__(self, tags: Iterable[str], limits: Limits = DEFAULT_LIMITS) -> None:
        if isinstance(tags, str):
            raise LocalProtocolError("tags is a str, not a sequence of str", code="bad_value", field="tags")
        wanted = list(dict.fromkeys(check_name(tag, "tag", limits.max_tag) for tag in tags))
        if len(wanted) > limits.max_tags:
            raise LocalProtocolError(
                f"{len(wanted)} tags, limit {limits.max_tags}", code="limit", field="tags", limit=limits.max_tags
            )
        self.wire = wanted  # what PULL asks the server for
        self.tags = frozenset(wanted)

    def matches(self, tags: Iterable[str]) -> bool:
        if not self.tags:
            return True
        wanted = self.tags
        return any(tag in wanted for tag in tags)


class FlowControl:
    """Messages and bytes held: pulled and not yet settled. Pulls stop at either cap.

    Bytes are message bodies. A pull asks for at most the room left, but a
    server hands out at least one message however large, so ``held_bytes``
    may pass its cap by one message.
    """

    __slots__ = ("max_messages", "max_bytes", "messages", "bytes")

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = check_int(max_messages, "max_messages_held", 1, 1 << 40)
        self.max_bytes = check_int(max_bytes, "max_bytes_held", 1, 1 << 50)
        self.messages = 0
        self.bytes = 0

    def room(self) -> tuple[int, int] | None:
        """(messages, bytes) a pull may still bring in; None when a cap is reached."""
        messages = self.max_messages - self.messages
        size = self.max_bytes - self.bytes
        if messages <= 0 or size <= 0:
            return None
        return messages, size

    def take(self, count: int, size: int) -> None:
        self.messages += count
        self.bytes += size

    def release(self, count: int, size: int) -> None:
        self.messages -= count
        self.bytes -= size


class PullLimit:
    """At most ``total`` messages pulled over the consumer's life (None: no limit).

    Each PULL on its way reserves what it asks for (one per lane: a server group's
    subject or retry subject), so pulls of several lanes at once never ask for
    more than is left together; its answer counts the records it held and frees
    the rest. A PULL whose answer is lost frees its reservation too: whatever it
    may have handed out goes back to the group (a gap's nack, or the release on close).

    A long poll holds its reservation while it waits, so a lane whose last answer
    was empty (or that has had none) asks for one message only, a lane that found
    no room goes before lanes that did not, and a pull that may hold what another
    lane will want (``brief``: an idle lane's, or one leaving less than a batch)
    polls briefly: a lane that has messages waits for it at most that long.
    """

    __slots__ = ("total", "pulled", "_asked", "_busy", "_wanting")

    def __init__(self, total: int | None) -> None:
        self.total = None if total is None else check_int(total, "limit", 1, 1 << 62)
        self.pulled = 0  # records the PULL answers held
        self._asked: dict[tuple[str, bool], int] = {}  # per lane, what its PULL on its way asks for
        self._busy: set[tuple[str, bool]] = set()  # lanes whose last answer held messages
        self._wanting: set[tuple[str, bool]] = set()  # lanes that found no room: they go first

    @property
    def reached(self) -> bool:
        """Every message the limit allows was pulled: nothing more is asked for."""
        return self.total is not None and self.pulled >= self.total

    def brief(self, lane: tuple[str, bool], batch: int) -> bool:
        """Whether the PULL ``lane`` just reserved for should poll briefly (see the class docstring)."""
        if self.total is None:
            return False
        return lane not in self._busy or self.total - self.pulled - sum(self._asked.values()) < batch

    def reserve(self, lane: tuple[str, bool], wanted: int) -> int:
        """What the next PULL of ``lane`` may ask for: ``wanted``, or less (0: none now) as
        the limit leaves; reserved until its answer."""
        if self.total is None:
            return wanted
        others = sum(count for key, count in self._asked.items() if key != lane)
        most = min(wanted if lane in self._busy else 1, self.total - self.pulled - others)
        if most <= 0 or (self._wanting and lane not in self._wanting):
            self._wanting.add(lane)
            return 0
        self._wanting.discard(lane)
        self._asked[lane] = most
        return most

    def answered(self, lane: tuple[str, bool], count: int) -> None:
        self._asked.pop(lane, None)
        self.pulled += count
        if count:
            self._busy.add(lane)
        else:
            self._busy.discard(lane)

    def abandoned(self, lane: tuple[str, bool]) -> None:
        self._asked.pop(lane, None)

    def forget(self, group: str) -> None:
        """``group`` left the route: its lanes pull no more, so none of them waits for room."""
        for lane in [lane for lane in (*self._asked, *self._wanting, *self._busy) if lane[0] == group]:
            self._asked.pop(lane, None)
            self._wanting.discard(lane)
            self._busy.discard(lane)


__all__ = ["FlowControl", "PullLimit", "TagFilter"]
