"""The errors of routed calls: no group to send to, or every attempt failed (and how)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class RouteError(Exception):
    """A routed request could not be served."""


class NoRouteError(RouteError, LookupError):
    """The route holds no group (or no metaserver ever answered for it)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a routed call that failed."""

    group: str  # "" when no group was known: the route itself could not be fetched
    address: str
    error: Exception

    def __str__(self) -> str:
        if not self.group:
            return f"route lookup: {self.error}"
        return f"group {self.group} at {self.address}: {self.error}"


class CallFailed(RouteError):
    """Every attempt of a routed call failed; ``attempts`` says how, in order."""

    def __init__(self, message: str, attempts: Sequence[Attempt]) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


class CallTimedOut(CallFailed):
    """A call with ``retry_for`` failed on every attempt until its time was up.

    ``attempts`` are all the failed tries, in order; ``rounds`` how many rounds
    of groups were tried; ``elapsed_ms`` how long the call ran on the client's clock.
    """

    def __init__(self, message: str, attempts: Sequence[Attempt], *, rounds: int, elapsed_ms: int) -> None:
        super().__init__(message, attempts)
        self.rounds = rounds
        self.elapsed_ms = elapsed_ms


__all__ = ["Attempt", "CallFailed", "CallTimedOut", "NoRouteError", "RouteError"]
