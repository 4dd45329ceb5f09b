"""Rates per token: how many requests a token may send, and messages and bytes its SENDs and SCHEDULEs
may carry, per second.

Sans-IO: ``RateLimiter.check`` is fed the identity a request acts as, the
messages and bytes of its batch and a monotonic time in milliseconds, and
answers None (taken from the token's buckets) or a ``RateRefusal``. Each rate is
a token bucket holding one second's worth (the burst a client may send at once
after a quiet second) that refills continuously. A refused batch takes nothing
from the buckets, so a client that waits ``retry_after_ms`` and sends it again
gets through. The buckets belong to one server process: a cluster of N groups
lets a token through N times its rate in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from delaymq.protocol.errors import ProtocolError

#: The code of a refusal for a token over its rate: retryable, after ``retry_after_ms``.
RATE_LIMITED = "rate_limited"
#: The fields of a token entry that set its rates (``None``: no limit, the default).
RATE_FIELDS = ("messages_per_s", "bytes_per_s", "requests_per_s")
_UNITS = {"messages_per_s": "messages/s", "bytes_per_s": "bytes/s", "requests_per_s": "requests/s"}


def describe_rate(field: str, rate: float) -> str:
    """``1000 messages/s``, ``1048576 bytes/s``."""
    shown = f"{rate:g}" if rate != int(rate) else str(int(rate))
    return f"{shown} {_UNITS[field]}"


class TokenBucket:
    """``rate`` units a second, holding at most one second's worth; starts full."""

    __slots__ = ("rate", "_level", "_at_ms")

    def __init__(self, rate: float, now_ms: int) -> None:
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"a rate must be a number above 0, not {rate!r}")
        self.rate = float(rate)
        self._level = self.rate
        self._at_ms = now_ms

    @property
    def capacity(self) -> float:
        return self.rate

    def level(self, now_ms: int) -> float:
        """The units available at ``now_ms`` (a clock that went back adds nothing)."""
        if now_ms > self._at_ms:
            self._level = min(self.capacity, self._level + (now_ms - self._at_ms) * self.rate / 1000)
            self._at_ms = now_ms
        return self._level

    def wait_ms(self, amount: float, now_ms: int) -> int:
        """Milliseconds until ``amount`` units are there (0: now); ``amount`` at most ``capacity``."""
        missing = amount - self.level(now_ms)
        return 0 if missing <= 0 else max(1, math.ceil(missing * 1000 / self.rate))

    def take(self, amount: float, now_ms: int) -> None:
        self._level = self.level(now_ms) - amount

    def give_back(self, amount: float, now_ms: int) -> None:
        """Return what a refused request took (never past one second's worth)."""
        self._level = min(self.capacity, self.level(now_ms) + amount)


@dataclass(frozen=True, slots=True)
class RateRefusal:
    """A batch over a token's rate: ``field`` the rate it broke, ``retry_after_ms`` None when it never fits."""

    message: str
    field: str
    rate: float
    retry_after_ms: int | None

    def error(self) -> ProtocolError:
        """``rate_limited`` (retryable, after ``retry_after_ms``), or ``limit`` for a batch larger than a second's worth."""
        limit = describe_rate(self.field, self.rate)
        if self.retry_after_ms is None:
            return ProtocolError(self.message, code="limit", field=self.field, limit=limit)
        return ProtocolError(
            self.message, code=RATE_LIMITED, field=self.field, limit=limit, retry_after_ms=self.retry_after_ms
        )


class RateLimiter:
    """The buckets of every token with a rate, by token name; a reload that changes a rate starts its bucket anew."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def check(
        self, name: str, rates: dict[str, float], amounts: dict[str, int], now_ms: int, *, command: str
    ) -> RateRefusal | None:
        """Take ``amounts`` (by ``RATE_FIELDS`` name) from ``name``'s buckets, or say which rate refuses them.

        Nothing is taken unless every rate has room, so a refusal costs the token nothing.
        """
        buckets: list[tuple[TokenBucket, int]] = []
        longest: RateRefusal | None = None
        for field, rate in rates.items():
            amount = amounts.get(field, 0)
            key = (name, field)
            bucket = self._buckets.get(key)
            if bucket is None or bucket.rate != rate:
                bucket = self._buckets[key] = TokenBucket(rate, now_ms)
            limit = describe_rate(field, rate)
            unit = _UNITS[field].split("/")[0]
            if amount > bucket.capacity:
                return RateRefusal(
                    f"{command}: a batch of {amount} {unit} is more than token {name!r} may send at once "
                    f"(its limit: {limit}, a burst of one second's worth); send smaller batches",
                    field,
                    rate,
                    None,
                )
            wait = bucket.wait_ms(amount, now_ms)
            if wait and (longest is None or (longest.retry_after_ms or 0) < wait):
                longest = RateRefusal(
                    f"{command}: token {name!r} is over its rate limit of {limit} on this server; retry in {wait} ms",
                    field,
                    rate,
                    wait,
                )
            buckets.append((bucket, amount))
        if longest is not None:
            return longest
        for bucket, amount in buckets:
            bucket.take(amount, now_ms)
        return None

    def give_back(self, name: str, amounts: dict[str, int], now_ms: int) -> None:
        """Return ``amounts`` that ``check`` took for a request the server then refused:
        a refused request costs the token nothing."""
        for field, amount in amounts.items():
            bucket = self._buckets.get((name, field))
            if bucket is not None:
                bucket.give_back(amount, now_ms)

    def forget(self, names: set[str]) -> None:
        """Drop the buckets of tokens no longer in the table (after a reload)."""
        for key in [key for key in self._buckets if key[0] not in names]:
            del self._buckets[key]


__all__ = ["RATE_FIELDS", "RATE_LIMITED", "RateLimiter", "RateRefusal", "TokenBucket", "describe_rate"]
