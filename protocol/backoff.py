"""Exponential backoff with jitter: how long to wait before the next retry.

One sans-IO policy for every retry loop (a producer's route calls, connects to
a peer, a consumer's pulls, the scheduler's deliveries, a server's registration
with the metaserver, the realtime index). ``Backoff`` is the policy: the
wait before retry *n* grows from ``initial_ms`` by ``multiplier`` up to
``maximum_ms``, then jitter spreads it so clients that failed together do not
all come back at the same moment (AWS's "Exponential Backoff and Jitter"):

- ``"full"``: uniform in [0, ceiling]; the best spread, but a wait may be ~0;
- ``"equal"``: uniform in [ceiling/2, ceiling]; never less than half, so a
  retry loop is never tight;
- ``"none"``: the ceiling itself (a plain doubling backoff).

``BackoffRun`` is one run of retries (one send, one address, one lane): it
counts the failures since the last success and hands out the next wait. The
random source is injected (any callable returning a float in [0, 1)), so a
test fixes the waits exactly. Nothing here reads a clock or sleeps.

Example::

    run = BackoffRun(Backoff(initial_ms=100, maximum_ms=5_000, jitter="equal"))
    while True:
        try:
            return attempt()
        except Retryable:
            await clock.sleep_ms(run.next_delay_ms())  # an interval of the monotonic clock
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: How a wait is spread below its ceiling.
Jitter = Literal["full", "equal", "none"]
_JITTERS = ("full", "equal", "none")

#: A source of floats in [0, 1), like ``random.random``.
RandomSource = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Backoff:
    """The policy: ceiling of wait *n* = min(maximum_ms, initial_ms × multiplier^(n−1)), then jitter."""

    initial_ms: int = 100
    maximum_ms: int = 5_000
    multiplier: float = 2.0
    jitter: Jitter = "full"

    def __post_init__(self) -> None:
        for name in ("initial_ms", "maximum_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} is {value!r}, must be an int of 0 or more milliseconds")
        if self.maximum_ms < self.initial_ms:
            raise ValueError(f"maximum_ms ({self.maximum_ms}) must be at least initial_ms ({self.initial_ms})")
        multiplier = self.multiplier
        if (
            not isinstance(multiplier, int | float)
            or isinstance(multiplier, bool)
            or not math.isfinite(multiplier)
            or multiplier < 1
        ):
            raise ValueError(f"multiplier is {multiplier!r}, must be a finite number of 1 or more")
        if self.jitter not in _JITTERS:
            raise ValueError(f"jitter is {self.jitter!r}, must be one of {', '.join(map(repr, _JITTERS))}")

    def ceiling_ms(self, retry: int) -> int:
        """The wait before retry ``retry`` (1 for the first) without jitter."""
        if retry < 1:
            raise ValueError(f"retry is {retry}, must be at least 1")
        if self.multiplier == 1 or self.initial_ms == 0:
            return self.initial_ms
        # Past this many doublings the ceiling is reached anyway (and the power would overflow).
        steps = min(retry - 1, math.ceil(math.log(max(self.maximum_ms, 1), self.multiplier)) + 1)
        return min(self.maximum_ms, math.ceil(self.initial_ms * self.multiplier**steps))

    def delay_ms(self, retry: int, u: float) -> int:
        """The wait before retry ``retry``, jittered by ``u`` in [0, 1) (from a random source)."""
        if not 0.0 <= u < 1.0:
            raise ValueError(f"u is {u!r}, must be in [0, 1)")
        ceiling = self.ceiling_ms(retry)
        if self.jitter == "full":
            return math.floor(ceiling * u)
        if self.jitter == "equal":
            half = ceiling // 2
            return half + math.floor((ceiling - half) * u)
        return ceiling


class BackoffRun:
    """One run of retries under a ``Backoff``: the waits grow until ``reset`` (a success)."""

    __slots__ = ("_random", "failures", "policy")

    def __init__(self, policy: Backoff, *, random: RandomSource | None = None) -> None:
        self.policy = policy
        self.failures = 0  # since the last reset
        self._random = random if random is not None else _random.random

    def next_delay_ms(self) -> int:
        """Count a failure; the wait before the retry that follows it."""
        self.failures += 1
        return self.policy.delay_ms(self.failures, self._random())

    def reset(self) -> None:
        self.failures = 0


__all__ = ["Backoff", "BackoffRun", "Jitter", "RandomSource"]
