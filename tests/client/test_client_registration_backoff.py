"""The registration agent's retries while the metaserver is down: jittered, never a tight loop.

Under ``autojump_clock`` against a caller that cannot reach the metaserver, so the
waits between attempts are exactly what the agent chose.
"""

from __future__ import annotations

import random
from collections import defaultdict
from functools import partial
from typing import Any

import trio
import trio.testing

from delaymq.client.registration import run_registration
from delaymq.clock import TrioClock
from delaymq.net.connection import PeerUnavailable
from delaymq.protocol.backoff import RandomSource
from delaymq.protocol.frames import Frame

T0 = 1_767_225_600_000
META = "meta:20880"
#: The agent's retry waits: from ``backoff_initial_ms`` (100) doubling up to the heartbeat interval.
INTERVAL_MS = 1_600
CEILINGS_MS = [100, 200, 400, 800, 1_600, 1_600, 1_600]


class DownMetaserver:
    """An ``AsyncCaller`` whose metaserver never answers; notes when each server tried it.

    ``enough`` is set once each of ``servers`` servers has made ``attempts`` attempts.
    """

    def __init__(self, *, servers: int, attempts: int) -> None:
        self.attempts: defaultdict[str, list[float]] = defaultdict(list)
        self._wanted = (servers, attempts)
        self.enough = trio.Event()

    async def call(self, address: str, command: int, metadata: dict[str, Any], *_: Any, **__: Any) -> Frame:
        self.attempts[metadata["address"]].append(trio.current_time())
        servers, attempts = self._wanted
        if sum(len(at) >= attempts for at in self.attempts.values()) == servers:
            self.enough.set()
        raise PeerUnavailable(f"cannot connect to {address}: connection refused", address=address)


def info(n: int) -> dict[str, Any]:
    return {"group": f"rt{n}", "kind": "realtime", "role": "master", "address": f"10.0.0.{n}:20881", "version": "1"}


async def waits_while_down(randoms: list[RandomSource]) -> list[list[int]]:
    """Each server's waits (ms) between its attempts, all of them having lost the metaserver together."""
    meta = DownMetaserver(servers=len(randoms), attempts=len(CEILINGS_MS) + 1)
    clock = TrioClock(T0)
    async with trio.open_nursery() as nursery:
        for n, source in enumerate(randoms):
            nursery.start_soon(
                partial(
                    run_registration, meta, meta_address=META, info=info(n), clock=clock,
                    interval_ms=INTERVAL_MS, random=source,
                )
            )  # fmt: skip
        with trio.fail_after(60):  # on the mock clock: the waits add up to under 7 s
            await meta.enough.wait()
        nursery.cancel_scope.cancel()
    waits = []
    for n in range(len(randoms)):
        at = meta.attempts[info(n)["address"]]
        waits.append([round((b - a) * 1000) for a, b in zip(at, at[1:])][: len(CEILINGS_MS)])
    return waits


async def test_servers_that_lost_the_metaserver_together_retry_spread_out_never_in_a_tight_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rng = random.Random(3)
    waits = await waits_while_down([rng.random for _ in range(30)])
    for n, ceiling in enumerate(CEILINGS_MS):
        nth = [each[n] for each in waits]
        assert all(ceiling // 2 <= wait <= ceiling for wait in nth), (n, nth)  # the floor, the cap
        assert len(set(nth)) > 15, (n, nth)  # not in lockstep


async def test_the_extremes_of_the_random_source_give_the_floor_and_the_ceiling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    floor, ceiling = await waits_while_down([lambda: 0.0, lambda: 1 - 1e-9])
    assert floor == [c // 2 for c in CEILINGS_MS]
    assert ceiling == [c - 1 for c in CEILINGS_MS]  # within the millisecond the policy rounds down
