"""The metaserver and its agents across wall-clock steps, and a group's master superseded.

Heartbeats and evictions are intervals of the monotonic clock: a ten-minute step
of the wall clock, back or forward, neither stops heartbeats (so nobody is
evicted) nor keeps a dead server routed. A server registering as its group's
master at a new address (a restart on another port) takes the routes at once;
the deposed one, if still running, is refused and never takes them back.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.registration import Registration
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError

META = "meta:20880"
MINUTE_MS = 60_000


def info(address: str = "10.0.0.1:20881", group: str = "rt1") -> dict[str, str]:
    return {"group": group, "kind": "realtime", "role": "master", "address": address, "version": "0.1.0"}


async def masters(network: MemoryNetwork) -> list[str]:
    answer = await network.call(META, Command.ROUTE, {"route": "immediate-producer"})
    return [group["address"] for group in answer.metadata["groups"]]


def step_warnings(caplog: pytest.LogCaptureFixture) -> int:
    return sum("the wall clock stepped" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# -- wall-clock steps -------------------------------------------------------------------


@pytest.mark.parametrize("step_ms", [-10 * MINUTE_MS, 10 * MINUTE_MS])
async def test_heartbeats_go_on_and_nobody_is_evicted_across_a_ten_minute_step(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture, step_ms: int
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        registration: Registration = await metaservers.start_agent(nursery, network, info("10.0.0.1:20881"))
        await trio.sleep(7)
        beats = registration.statistics().heartbeats
        metaservers.clock.step(step_ms)
        for _ in range(4 * 30):  # four eviction timeouts, looked at every second
            await trio.sleep(1)
            assert await masters(network) == ["10.0.0.1:20881"]
        assert registration.statistics().heartbeats - beats == 24  # every 5 s, as before the step
        assert registration.statistics().failures == 0
        status = (await network.call(META, Command.STATUS)).metadata
        assert status["rows"][0]["seconds_since_heartbeat"] < 5
        assert meta.statistics().registry.evicted_servers == 0
    assert step_warnings(caplog) == 1


@pytest.mark.parametrize("step_ms", [-10 * MINUTE_MS, 10 * MINUTE_MS])
async def test_a_dead_server_is_evicted_on_time_whichever_way_the_clock_steps(
    autojump_clock: trio.testing.MockClock, metaservers: Any, step_ms: int
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        await metaservers.register_then_die(network, info("10.0.0.1:20881"))  # it dies right after registering
        died = trio.current_time()
        metaservers.clock.step(step_ms)
        with trio.fail_after(60):
            while await masters(network):
                await trio.sleep(0.5)
        assert 30 <= trio.current_time() - died <= 31.5  # evict_after, by the monotonic clock


# -- a group's master superseded ---------------------------------------------------------


async def test_a_master_restarted_on_a_new_port_takes_the_routes_at_once(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.metaserver")
    async with metaservers.on_network() as (meta, network, nursery):
        await metaservers.register_then_die(network, info("127.0.0.1:4001"))  # SIGKILLed
        await trio.sleep(2)
        await metaservers.start_agent(nursery, network, info("127.0.0.1:4002"))  # restarted on another port
        assert await masters(network) == ["127.0.0.1:4002"]  # at once, not after 30 s of eviction
        rows = (await network.call(META, Command.STATUS)).metadata["rows"]
        assert [row["address"] for row in rows] == ["127.0.0.1:4002"]
        assert "server 127.0.0.1:4002 superseded 127.0.0.1:4001 as master of group rt1" in caplog.text


async def test_a_deposed_master_still_running_is_refused_and_never_takes_the_group_back(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        first: Registration = await metaservers.start_agent(nursery, network, info("10.0.0.1:1"))
        await trio.sleep(1)
        second: Registration = await metaservers.start_agent(nursery, network, info("10.0.0.2:1"))
        assert await masters(network) == ["10.0.0.2:1"]
        for _ in range(12):  # a minute of both running: no flapping
            await trio.sleep(5)
            assert await masters(network) == ["10.0.0.2:1"]
        assert first.superseded and not first.is_master and not first.registered
        assert second.is_master and second.statistics().failures == 0
        refusals = [r.getMessage() for r in caplog.records if r.name == "delaymq.client.registration"]
        assert len(refusals) == 1  # said once, not at every heartbeat
        assert "10.0.0.1:1 was superseded as master of group 'rt1' by 10.0.0.2:1" in refusals[0]
        with pytest.raises(PeerError) as refused:
            await network.call(META, Command.HEARTBEAT, {"group": "rt1", "address": "10.0.0.1:1"})
        assert refused.value.code == "superseded" and refused.value.field == "address"


async def test_the_deposed_master_restarted_supersedes_in_turn(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        async with trio.open_nursery() as old:
            await metaservers.start_agent(old, network, info("10.0.0.1:1"))
            await metaservers.start_agent(nursery, network, info("10.0.0.2:1"))
            old.cancel_scope.cancel()
        await metaservers.start_agent(nursery, network, info("10.0.0.1:1"))  # restarted: a new incarnation
        assert await masters(network) == ["10.0.0.1:1"]


async def test_a_server_restarting_on_its_own_address_is_routed_at_its_registration(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        await metaservers.register_then_die(network, info("10.0.0.1:1"))
        await trio.sleep(45)  # down past its eviction
        assert await masters(network) == []
        await metaservers.start_agent(nursery, network, info("10.0.0.1:1"))
        assert await masters(network) == ["10.0.0.1:1"]


async def test_superseded_masters_are_remembered_across_a_metaserver_restart(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    old_info: dict[str, Any] = {**info("10.0.0.1:1"), "incarnation": "first-run"}
    async with metaservers.on_network() as (meta, network, nursery):
        await network.call(META, Command.REGISTER, old_info)
        await network.call(META, Command.REGISTER, {**info("10.0.0.2:1"), "incarnation": "other"})
    async with metaservers.on_network() as (meta, network, nursery):
        with pytest.raises(PeerError) as refused:
            await network.call(META, Command.REGISTER, old_info)
        assert refused.value.code == "superseded"
        assert await masters(network) == ["10.0.0.2:1"]
