"""A message as a consumer hands it to the application, settled with ``ack()`` or ``nack()``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, eq=False)
class ReceivedMessage:
    """A message handed to this consumer; settle it with ``ack()`` or ``nack()``.

    From a trio ``Consumer`` ``ack()``/``nack()`` are awaited; from a
    ``BlockingConsumer`` they are plain calls. ``received_at``, ``deliver_at``
    and ``created_at`` are epoch milliseconds (UTC); ``received_at`` is when it
    reached this process, or, for one that waited in it (fetched ahead of its
    ``deliver_at``), when it was released to the application. ``server_group`` and
    ``sequence`` say where it sits in this consumer's pull log. A message that
    came back after a nack keeps its id and ``subject``; ``attempts`` counts
    the deliveries before this one, ``deliver_at`` is when the retry was due,
    and ``pulled_subject`` is the group's retry subject it was pulled from.
    """

    id: str
    subject: str
    tags: tuple[str, ...]
    properties: dict[str, Any]
    body: bytes
    deliver_at: int
    created_at: int
    attempts: int
    received_at: int
    server_group: str
    sequence: int
    _: KW_ONLY
    pulled_subject: str = ""  # "" or ``subject``: pulled from the subject itself
    epoch: int = field(default=0, repr=False)
    settle: Callable[[ReceivedMessage, bool], Any] | None = field(default=None, repr=False)

    def ack(self) -> Any:
        """Done with it: the group will not hand it out again."""
        return self._settle(True)

    def nack(self) -> Any:
        """Not done: it comes back after the group's next retry delay, or goes to the dead letters.

        The dead-letter subject ``%dead%<group>%<subject>`` takes it after the
        consumer's ``max_attempts``-th delivery. A broadcast consumer gets it
        back at once.
        """
        return self._settle(False)

    def _settle(self, ack: bool) -> Any:
        if self.settle is None:
            raise RuntimeError("this message was not received from a consumer")
        return self.settle(self, ack)

    @property
    def lateness_ms(self) -> int:
        """How long after its ``deliver_at`` it reached the application (``received_at``)."""
        return self.received_at - self.deliver_at

    def text(self) -> str:
        """The body as UTF-8 text (``UnicodeDecodeError`` if it is not)."""
        return self.body.decode()


__all__ = ["ReceivedMessage"]
