"""The clients' route layer: routed sends, retries on other groups, avoidance, stale routes.

Driven with ``autojump_clock`` against a real metaserver and fake server groups
over in-memory streams (the blocking clients run this same code: test_client_blocking.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.faults import AvoidancePolicy
from delaymq.client.routes import (
    CALL_BACKOFF,
    CallFailed,
    CallTimedOut,
    NoRouteError,
    RouteClient,
    RouteTable,
)
from delaymq.clock import TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import PeerUnavailable, RequestTimeout
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.testing import MemoryNetwork, ServeStream
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.frames import request, response_to
from delaymq.storage.threads import run_inline

T0 = 1_700_000_000_000
META = "meta:20880"
PRODUCE = "immediate-producer"


@dataclass
class FakeGroup:
    """A realtime group's master that takes SEND, or refuses it, or answers slowly."""

    name: str
    refuse: str | None = None
    delay: float = 0.0
    received: int = 0

    async def send(self, request: Request) -> dict[str, Any]:
        self.received += 1
        if self.delay:
            await trio.sleep(self.delay)
        if self.refuse:
            raise RemoteProtocolError(f"{self.name} refuses: {self.refuse}", code=self.refuse, field="subject")
        return {"group": self.name}

    def server(self) -> FrameServer:
        return FrameServer({Command.SEND: self.send})


@dataclass
class World:
    network: MemoryNetwork
    clock: TrioClock
    groups: dict[str, FakeGroup]
    meta: ServeStream

    async def register(
        self, name: str, *, kind: str = "realtime", refuse: str | None = None, delay: float = 0.0
    ) -> FakeGroup:
        address = f"{name}:20881"
        group = self.groups[name] = FakeGroup(name, refuse, delay)
        self.network.serve(address, group.server().serve_stream)
        info = {"group": name, "kind": kind, "role": "master", "address": address, "version": "0.1.0"}
        await self.network.call(META, Command.REGISTER, info)
        return group

    async def set_state(self, name: str, state: str) -> None:
        await self.network.call(META, Command.SET_STATE, {"group": name, "state": state})

    def client(self, **options: Any) -> RouteClient:
        return RouteClient(self.network, [META], clock=self.clock, **options)


@asynccontextmanager
async def world(tmp_path: Path) -> AsyncIterator[World]:
    clock = TrioClock(T0)
    # Long eviction: these tests are about the clients, not heartbeats.
    async with (
        open_metaserver(
            listen=None,
            data_dir=tmp_path,
            clock=clock,
            run_blocking=run_inline,
            evict_after_ms=3_600_000,
            heartbeat_interval_ms=5_000,
        ) as meta,
        trio.open_nursery() as nursery,
    ):
        network = MemoryNetwork(nursery)
        network.serve(META, meta.serve_stream)
        yield World(network, clock, {}, meta.serve_stream)
        nursery.cancel_scope.cancel()


async def send(client: RouteClient, **options: Any) -> str:
    frame = await client.call(PRODUCE, Command.SEND, {"n": 1}, b"records", **options)
    return str(frame.metadata["group"])


async def test_send_refused_by_one_group_goes_to_another(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        rt1 = await w.register("rt1", refuse="read_only")
        rt2 = await w.register("rt2")
        client = w.client()
        assert [await send(client) for _ in range(6)] == ["rt2"] * 6
        assert rt1.received == 1  # refused once, then avoided
        assert rt2.received == 6
        stats = client.statistics()
        assert (stats.calls, stats.retries, stats.refused) == (6, 1, 1)
        assert stats.fetches == 2  # the refusal made the client ask the metaserver again


async def test_refusal_about_the_request_itself_is_raised_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        rt1 = await w.register("rt1", refuse="limit")
        rt2 = await w.register("rt2", refuse="limit")
        client = w.client()
        with pytest.raises(PeerError) as refused:
            await send(client)
        assert refused.value.code == "limit" and "rt1 refuses" in str(refused.value)
        assert (rt1.received, rt2.received) == (1, 0)  # another group would refuse it too
        assert client.statistics().retries == 0


async def test_group_that_leaves_the_routes_is_dropped_after_the_next_refresh(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        await w.register("rt2")
        client = w.client(refresh_interval_ms=30_000)
        assert sorted([await send(client) for _ in range(4)]) == ["rt1", "rt1", "rt2", "rt2"]
        await w.set_state("rt2", "R")  # read-only: no longer for producers
        await trio.sleep(31)
        answer = await client.groups(PRODUCE)
        assert [g.group for g in answer.groups] == ["rt1"]
        assert [await send(client) for _ in range(4)] == ["rt1"] * 4
        consumer = await client.groups("consumer")
        assert [(g.group, g.state.value, g.address) for g in consumer.groups] == [
            ("rt1", "RW", "rt1:20881"),
            ("rt2", "R", "rt2:20881"),
        ]


async def test_slow_group_is_avoided_for_a_while(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        slow = await w.register("rt1", delay=1.0)  # 1000 ms: avoided for 60 s by the default policy
        fast = await w.register("rt2")
        client = w.client(refresh_interval_ms=600_000)
        assert await send(client) == "rt1"  # round robin starts at rt1; it answers, slowly
        assert client.statistics().faults.entries[0].last_latency_ms == 1000
        for _ in range(10):
            assert await send(client) == "rt2"
            await trio.sleep(5)
        assert slow.received == 1 and fast.received == 10
        await trio.sleep(15)  # 60 s after the slow answer
        assert sorted([await send(client) for _ in range(2)]) == ["rt1", "rt2"]


async def test_failed_group_is_avoided_and_the_send_retried(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        await w.register("rt2")
        w.network.take_down("rt1:20881")  # still registered, but unreachable
        client = w.client(policy=AvoidancePolicy(failure_avoid_ms=60_000))
        assert [await send(client) for _ in range(5)] == ["rt2"] * 5
        stats = client.statistics()
        assert (stats.unanswered, stats.retries) == (1, 1)
        (fault,) = [f for f in stats.faults.entries if f.group == "rt1"]
        # Avoidance runs on the monotonic clock (a wall-clock step must not stretch it): 60 s from the failure.
        assert fault.consecutive_failures == 1 and fault.available_from_ms == fault.last_failure_ms + 60_000


async def test_every_attempt_failing_raises_call_failed_naming_each(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1", refuse="not_master")
        await w.register("rt2", refuse="unavailable")
        client = w.client()
        with pytest.raises(CallFailed) as failed:
            await send(client, attempts=2)
        message = str(failed.value)
        assert "SEND on route 'immediate-producer' failed 2 times" in message
        assert "group rt1 at rt1:20881: rt1 refuses: not_master" in message
        assert "group rt2 at rt2:20881: rt2 refuses: unavailable" in message
        assert [a.group for a in failed.value.attempts] == ["rt1", "rt2"]


async def test_stale_routes_are_used_while_the_metaserver_is_down(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        client = w.client(refresh_interval_ms=30_000)
        assert await send(client) == "rt1"
        w.network.take_down(META)
        await trio.sleep(120)  # the routes are long stale
        assert [await send(client) for _ in range(3)] == ["rt1"] * 3
        assert [g.group for g in (await client.groups(PRODUCE)).groups] == ["rt1"]
        stats = client.statistics()
        assert stats.fetch_failures == 1 and stats.stale_served == 1  # asked once, not per send
        await trio.sleep(1)
        await send(client)
        assert client.statistics().fetch_failures == 2  # and again after meta_retry_ms


async def test_metaservers_are_tried_in_turn(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        client = RouteClient(w.network, ["down:1", META], clock=w.clock)
        assert await send(client) == "rt1"
        await trio.sleep(31)
        await send(client)
        assert w.network.calls["down:1"] == 1  # the one that answered is asked first
        assert w.network.calls[META] == 1 + 2  # REGISTER, then two fetches


async def test_unchanged_routes_cost_no_group_list(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        client = w.client(refresh_interval_ms=30_000)
        first = await client.groups(PRODUCE)
        assert client.table.fetch_plan(client.table.key(PRODUCE))[0][1] == {
            "route": PRODUCE,
            "known_version": first.version,
        }
        await trio.sleep(31)
        assert await client.groups(PRODUCE) is first
        assert client.statistics().fetches == 2


async def test_no_route_error_says_what_is_missing_and_what_was_answered(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("sched1", kind="scheduler")
        client = w.client()
        with pytest.raises(NoRouteError) as none:
            await send(client)
        version = (await client.groups(PRODUCE)).version
        assert str(none.value) == (
            "no realtime group in RW serves immediate producers; metaserver meta:20880 answered "
            f"route 'immediate-producer' (version {version}) with 0 groups"
        )
        unreachable = RouteClient(w.network, ["127.0.0.1:1"], clock=w.clock)
        with pytest.raises(NoRouteError) as down:
            await unreachable.call("delayed-producer", Command.SCHEDULE)
        assert str(down.value) == (
            "no scheduler group in RW serves delayed producers; no metaserver answered: "
            "metaserver 127.0.0.1:1: cannot connect to 127.0.0.1:1: it is down"
        )


async def test_a_route_answered_empty_is_asked_again_soon_and_a_group_that_registers_is_used(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        client = w.client(refresh_interval_ms=30_000)  # meta_retry_ms: 1 s
        with pytest.raises(NoRouteError):
            await send(client)
        await w.register("rt1")  # a group registers (again, say, after it was evicted while down)
        with pytest.raises(NoRouteError):
            await send(client)  # not asked again at every call...
        assert client.statistics().fetches == 1
        await trio.sleep(1)
        assert await send(client) == "rt1"  # ...but after meta_retry_ms, not the refresh interval
        assert client.statistics().fetches == 2
        await trio.sleep(10)
        await send(client)
        assert client.statistics().fetches == 2  # a route with groups keeps the refresh interval


def test_route_table_refuses_bad_routes_by_name() -> None:
    table = RouteTable(["m:1"])
    with pytest.raises(ValueError, match="route 'producer' is not one of 'delayed-producer'"):
        table.key("producer")
    with pytest.raises(ValueError, match="subject: the scheduler-delivery route needs a subject"):
        table.key("scheduler-delivery")
    with pytest.raises(RemoteProtocolError) as malformed:
        table.accept(table.key("consumer"), "m:1", {"version": 3, "groups": [{"group": "g"}]}, 0)
    assert malformed.value.field == "groups[0]"


# -- calls that ride out an outage (retry_for) ------------------------------------


class Recorder:
    """The network, noting when (client clock, ms) each request to a group was made."""

    def __init__(self, network: MemoryNetwork, clock: TrioClock) -> None:
        self.network = network
        self.clock = clock
        self.times: dict[str, list[int]] = {}

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Any:  # fmt: skip
        if command != Command.ROUTE:
            self.times.setdefault(address, []).append(self.clock.now_ms())
        return await self.network.call(address, command, metadata, body, timeout=timeout)


def gaps(times: list[int]) -> list[int]:
    return [later - earlier for earlier, later in zip(times, times[1:])]


async def test_a_call_with_retry_for_waits_out_the_only_groups_outage_with_backoff(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        group = await w.register("rt1")
        recorder = Recorder(w.network, w.clock)
        client = RouteClient(recorder, [META], clock=w.clock, random=lambda: 0.0)
        assert await send(client) == "rt1"  # the route is known and the group healthy
        w.network.take_down("rt1:20881")  # the only group restarts...
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(send, client, retry_for=30))
            await trio.sleep(0.8)
            w.network.serve("rt1:20881", group.server().serve_stream)  # ...and is back 0.8 s later
        times = recorder.times["rt1:20881"][1:]
        assert times[0] == T0 and times[-1] > T0 + 800  # the call outlived the outage
        assert gaps(times) == [CALL_BACKOFF.delay_ms(n, 0.0) for n in range(1, len(times))]
        assert gaps(times) == sorted(gaps(times)) and min(gaps(times)) >= 50  # growing, never a tight loop
        assert group.received == 2
        stats = client.statistics()
        assert (stats.calls, stats.unanswered, stats.retries) == (2, len(times) - 1, len(times) - 1)


async def test_a_call_with_retry_for_tries_every_group_then_backs_off_and_says_what_it_tried(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        await w.register("rt2")
        w.network.take_down("rt1:20881")
        w.network.take_down("rt2:20881")
        recorder = Recorder(w.network, w.clock)
        client = RouteClient(recorder, [META], clock=w.clock, random=lambda: 0.0)
        with pytest.raises(CallTimedOut) as timed_out:
            await send(client, retry_for=2)
        rt1, rt2 = recorder.times["rt1:20881"], recorder.times["rt2:20881"]
        assert rt1 == rt2  # each round tries the other group at once, then waits
        assert gaps(rt1) == [CALL_BACKOFF.delay_ms(n, 0.0) for n in range(1, len(rt1))]
        error = timed_out.value
        assert isinstance(error, CallFailed)  # what callers caught before still catches it
        assert len(error.attempts) == 2 * len(rt1) and error.rounds == len(rt1)
        assert error.elapsed_ms == w.clock.now_ms() - T0 <= 2000
        message = str(error)
        assert message.startswith(
            f"SEND on route 'immediate-producer' gave up after {error.elapsed_ms / 1000:.1f} s (retry_for is 2 s): "
            f"{2 * len(rt1)} failed attempts in {len(rt1)} rounds with backoff; "
        )
        for name in ("rt1", "rt2"):
            assert (
                f"group {name} at {name}:20881: {len(rt1)} attempts, last error: "
                f"cannot connect to {name}:20881: it is down"
            ) in message


async def test_a_call_with_retry_for_goes_to_a_healthy_group_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        await w.register("rt2")
        w.network.take_down("rt1:20881")
        client = w.client()
        assert await send(client, retry_for=30) == "rt2"
        assert w.clock.now_ms() == T0  # no backoff: another group was there to try


async def test_a_call_with_retry_for_still_raises_a_refusal_of_the_request_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        group = await w.register("rt1", refuse="limit")
        client = w.client()
        with pytest.raises(PeerError) as refused:
            await send(client, retry_for=30)
        assert refused.value.code == "limit"
        assert (group.received, w.clock.now_ms()) == (1, T0)
        with pytest.raises(NoRouteError, match="no scheduler group in RW"):  # answered with no group: at once
            await client.call("delayed-producer", Command.SCHEDULE, {}, b"x", retry_for=30)
        assert w.clock.now_ms() == T0


async def test_a_call_with_retry_for_waits_for_a_metaserver_to_answer(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        await w.register("rt1")
        w.network.take_down(META)  # restarting as the client starts
        client = w.client()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(send, client, retry_for=30))
            await trio.sleep(2)
            assert client.statistics().fetch_failures >= 2  # asked, and asked again
            w.network.serve(META, w.meta)
        assert client.statistics().calls == 1 and client.statistics().fetches == 1
        with pytest.raises(CallTimedOut, match=r"route lookup: \d+ attempts, last error: no realtime group"):
            w.network.take_down(META)
            await RouteClient(w.network, [META], clock=w.clock).call(PRODUCE, Command.SEND, retry_for=5)


async def test_retry_for_must_be_a_positive_number_of_seconds(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with world(tmp_path) as w:
        client = w.client()
        for bad in (0, -1, float("nan"), "30"):
            with pytest.raises(ValueError, match=f"retry_for is {bad!r}; it must be a number of seconds more than 0"):
                await send(client, retry_for=bad)


class SilentMetaservers:
    """Metaservers that answer the first ROUTE (one group, which is down), then never again."""

    def __init__(self) -> None:
        self.route_calls = 0

    async def call(
        self, address: str, command: int, metadata: Any = None, body: bytes = b"", *, timeout: float | None = None
    ) -> Any:
        if command == Command.ROUTE:
            self.route_calls += 1
            if self.route_calls == 1:
                group = {"group": "g1", "address": "g1:1", "slaves": [], "kind": "realtime", "state": "RW"}
                return response_to(request(Command.ROUTE, 1, {}), {"version": 1, "groups": [group]})
            await trio.sleep(timeout or 0)  # a metaserver whose packets are dropped
            raise RequestTimeout("no answer", address=address)
        await trio.lowlevel.checkpoint()
        raise PeerUnavailable("down", address=address)


async def test_silent_metaservers_do_not_hold_a_send_past_its_timeout(autojump_clock: trio.testing.MockClock) -> None:
    client = RouteClient(SilentMetaservers(), ["m1:1", "m2:1"], clock=TrioClock(T0), meta_timeout=5.0)
    started = trio.current_time()
    with pytest.raises(CallTimedOut):
        await client.call(PRODUCE, Command.SEND, {}, b"x", retry_for=2.0, timeout=1.0)
    assert trio.current_time() - started <= 2.0  # each route lookup would take 2 x 5 s on its own
