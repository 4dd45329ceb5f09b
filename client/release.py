"""The consumer's release queue: received messages, each handed to the application from its due moment on.

A consumer that pulls with ``fetch_ahead`` takes records a scheduler sent ahead of
their ``deliver_at`` up to that long before they are due (one PULL per SEND instead
of one per release tick of the realtime server), so it holds them itself: a
scheduled message (``deliver_at`` after ``created_at``) is released when this
process's clock reads its ``deliver_at``, never earlier, and never later than
``fetch_ahead`` after it arrived (a clock behind the servers' by more than that
does not hold it longer). Messages behind a held one from the same lane (a realtime
group's subject, or its retry subject) wait with it, so a subject's order holds;
other lanes pass. ``received_at`` of a message that waited here is the moment it
was released.

Sans-IO: fed messages and the time, asked what is due and when the next is.
"""

from __future__ import annotations

from collections import deque

from delaymq.client.delivery import ReceivedMessage

#: The slot's setter: a released message is stamped once, before the application sees it
#: (``ReceivedMessage`` is frozen for the application, not for the queue that hands it out).
_set_received_at = ReceivedMessage.__dict__["received_at"].__set__


class ReleaseQueue:
    """Messages received and not handed to the application yet (see the module docstring)."""

    __slots__ = ("ahead_ms", "_ready", "_held", "_count")

    def __init__(self, *, ahead_ms: int) -> None:
        self.ahead_ms = ahead_ms
        self._ready: deque[ReceivedMessage] = deque()
        #: Per lane (server group, pulled subject): (release moment, message), in arrival order.
        self._held: dict[tuple[str, str], deque[tuple[int, ReceivedMessage]]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, messages: list[ReceivedMessage], now_ms: int) -> None:
        """Messages of one PULL answer (``received_at``: when it arrived), in order."""
        ahead, ready, held = self.ahead_ms, self._ready, self._held
        self._count += len(messages)
        for message in messages:
            lane = held.get((message.server_group, message.pulled_subject)) if held else None
            deliver_at = message.deliver_at
            if lane is None and (deliver_at <= now_ms or deliver_at <= message.created_at):
                # Due, or not a scheduled message: nothing to wait for. One that arrived before
                # it was due (and waited to be taken) reaches the application now.
                if message.received_at < deliver_at and deliver_at > message.created_at:
                    _set_received_at(message, now_ms)
                ready.append(message)
                continue
            # Not scheduled (behind a held one): released as soon as it is first in its lane.
            release = min(deliver_at, message.received_at + ahead) if deliver_at > message.created_at else 0
            if lane is None:
                held[(message.server_group, message.pulled_subject)] = deque([(release, message)])
            else:
                lane.append((release, message))

    def take(self, now_ms: int, max_messages: int | None = None) -> list[ReceivedMessage]:
        """The messages due at ``now_ms`` (up to ``max_messages``), in order within each lane."""
        if self._held:
            self._release(now_ms)
        ready = self._ready
        count = len(ready) if max_messages is None else min(len(ready), max_messages)
        self._count -= count
        if count == len(ready):
            out = list(ready)
            ready.clear()
            return out
        return [ready.popleft() for _ in range(count)]

    def drain(self) -> list[ReceivedMessage]:
        """Every message here, due or held, taken out (the consumer is closing: they go back)."""
        out = list(self._ready)
        self._ready.clear()
        for lane in self._held.values():
            out.extend(message for _release, message in lane)
        self._held.clear()
        self._count = 0
        return out

    def next_release(self) -> int | None:
        """When the earliest held lane's first message is due (epoch ms), or None if none is held."""
        if not self._held:
            return None
        return min(lane[0][0] for lane in self._held.values())

    def _release(self, now_ms: int) -> None:
        ready = self._ready
        for key, lane in list(self._held.items()):
            while lane and lane[0][0] <= now_ms:
                message = lane.popleft()[1]
                _set_received_at(message, now_ms)  # it reaches the application now
                ready.append(message)
            if not lane:
                del self._held[key]


__all__ = ["ReleaseQueue"]
