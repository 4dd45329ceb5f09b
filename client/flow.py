"""What a consumer lets through and how much it holds: the exact tag check and the flow caps.

The server filters by a 64-bit mask, which lets through tags that share a bit,
so ``TagFilter`` makes the exact check here (a message whose tags do not match
is acked silently and never shown). ``FlowControl`` counts the messages and
bytes held (pulled, not yet acked or nacked); pulls stop while either cap is
reached.
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


__all__ = ["FlowControl", "TagFilter"]
