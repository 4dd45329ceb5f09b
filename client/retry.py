"""Consumer retries, sans-IO: how long a nacked message waits, and when it is dead.

A consumer group's nack sends the message back through a scheduler with a
growing delay (``RetryPolicy.delay_for``); the nack of its last attempt
(``RetryPolicy.is_last``) sends it to the group's dead-letter subject instead.
The policy lives with the consumer group: every consumer of a group should be
opened with the same one. ``attempts`` is what a received message carries: the
deliveries tried before this one (0 for the first), so with ``max_attempts``
16 a message is handed out at most 16 times.

The retry and dead-letter subjects (``%retry%<group>%<subject>``,
``%dead%<group>%<subject>``) are named by ``delaymq.protocol.subjects``, the
rules servers and clients share.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

from delaymq.client.messages import seconds_to_ms
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.fields import check_int
from delaymq.protocol.limits import TWO_YEARS_MS
from delaymq.protocol.records import MAX_ATTEMPTS

#: 5 s, 10 s, 30 s, 1 min, 2 min, 5 min, 10 min, 30 min, 1 h, then 2 h for each further attempt.
DEFAULT_RETRY_DELAYS_MS: tuple[int, ...] = (
    5_000,
    10_000,
    30_000,
    60_000,
    120_000,
    300_000,
    600_000,
    1_800_000,
    3_600_000,
    7_200_000,
)
#: The same in seconds, the form ``open_consumer(retry_delays=...)`` takes.
DEFAULT_RETRY_DELAYS: tuple[float, ...] = tuple(ms / 1000 for ms in DEFAULT_RETRY_DELAYS_MS)
DEFAULT_MAX_ATTEMPTS = 16
#: How many delays a policy may list.
MAX_DELAYS = 1000


class RetryNack(NamedTuple):
    """What a NACK asks for: come back after ``delay_ms``, or (``dead``) go to the dead letters."""

    delay_ms: int
    dead: bool


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """A consumer group's retry delays (ms, the last one repeats) and its attempt limit."""

    retry_delays_ms: tuple[int, ...] = DEFAULT_RETRY_DELAYS_MS
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    def __post_init__(self) -> None:
        delays = self.retry_delays_ms
        if not isinstance(delays, tuple):
            raise LocalProtocolError(
                f"retry_delays is of type {type(delays).__name__}, not a tuple", code="bad_value", field="retry_delays"
            )
        if not 1 <= len(delays) <= MAX_DELAYS:
            raise LocalProtocolError(
                f"retry_delays lists {len(delays)} delays, must be 1 to {MAX_DELAYS}",
                code="limit",
                field="retry_delays",
                limit=MAX_DELAYS if delays else 1,
            )
        for index, delay in enumerate(delays):
            if not isinstance(delay, int) or isinstance(delay, bool):
                raise LocalProtocolError(
                    f"retry_delays[{index}] is of type {type(delay).__name__}, not int (milliseconds)",
                    code="bad_value",
                    field="retry_delays",
                )
            if not 0 <= delay <= TWO_YEARS_MS:
                raise LocalProtocolError(
                    f"retry_delays[{index}] is {delay} ms, must be 0 to {TWO_YEARS_MS} (two years)",
                    code="limit",
                    field="retry_delays",
                    limit=TWO_YEARS_MS if delay > 0 else 0,
                )
        check_int(self.max_attempts, "max_attempts", 1, MAX_ATTEMPTS)

    @classmethod
    def from_options(
        cls,
        retry_delays: Iterable[float | int | timedelta] = DEFAULT_RETRY_DELAYS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> RetryPolicy:
        """The policy of the consumer options: delays in seconds (or timedeltas), rounded up to the ms."""
        if isinstance(retry_delays, str | bytes) or not isinstance(retry_delays, Iterable):
            raise LocalProtocolError(
                f"retry_delays is of type {type(retry_delays).__name__}; give a sequence of seconds",
                code="bad_value",
                field="retry_delays",
            )
        delays = tuple(
            seconds_to_ms(delay, name=f"retry_delays[{index}]", field="retry_delays")
            for index, delay in enumerate(retry_delays)
        )
        return cls(delays, max_attempts)  # the range of each delay is checked by the policy

    def delay_for(self, attempts: int) -> int:
        """The delay (ms) before a message nacked after ``attempts`` earlier deliveries comes back."""
        delays = self.retry_delays_ms
        return delays[min(max(attempts, 0), len(delays) - 1)]

    def is_last(self, attempts: int) -> bool:
        """Whether the delivery that carried ``attempts`` was the last one allowed."""
        return attempts + 1 >= self.max_attempts

    def nack_for(self, attempts: int) -> RetryNack:
        """What the NACK of a message with ``attempts`` asks the server for."""
        if self.is_last(attempts):
            return RetryNack(0, True)
        return RetryNack(self.delay_for(attempts), False)


__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_RETRY_DELAYS",
    "DEFAULT_RETRY_DELAYS_MS",
    "RetryNack",
    "RetryPolicy",
]
