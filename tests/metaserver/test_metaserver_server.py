"""The networked metaserver and the servers' registration agent.

Most tests drive the metaserver over in-memory streams with ``autojump_clock``
(store calls inline, so time never races a thread); a few run it on loopback
with the real clock to check the byte-level refusals.
"""

from __future__ import annotations

import logging
import socket
import struct
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.registration import (
    Registration,
    RegistrationRefused,
    run_registration,
    software_version,
    start_registration,
)
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.frames import Frame, FrameDecoder, encode_frame, request
from delaymq.protocol.routes import ServerKind

T0 = 1_700_000_000_000
META = "meta:20880"


def server_info(
    group: str = "rt1", address: str = "10.0.0.1:20881", kind: str = "realtime", role: str = "master"
) -> dict[str, str]:
    return {"group": group, "kind": kind, "role": role, "address": address, "version": "0.1.0"}


async def route(network: MemoryNetwork, name: str, subject: str | None = None, **extra: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"route": name, **extra}
    if subject is not None:
        metadata["subject"] = subject
    return (await network.call(META, Command.ROUTE, metadata)).metadata


async def routed(network: MemoryNetwork, name: str, subject: str | None = None) -> list[str]:
    return [g["group"] for g in (await route(network, name, subject))["groups"]]


# -- registration, heartbeats, eviction ----------------------------------------------


async def test_agent_registers_and_heartbeats_keep_its_group_routed(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        registration: Registration = await metaservers.start_agent(nursery, network, server_info())
        assert (registration.state, registration.master_address, registration.is_master) == (
            "RW",
            "10.0.0.1:20881",
            True,
        )
        assert registration.heartbeat_interval_ms == 5_000
        answer = await route(network, "immediate-producer")
        assert answer["groups"] == [
            {"group": "rt1", "kind": "realtime", "state": "RW", "address": "10.0.0.1:20881", "slaves": []}
        ]
        await trio.sleep(122)  # four eviction timeouts: heartbeats (+5 s ... +120 s) keep it in
        assert await routed(network, "immediate-producer") == ["rt1"]
        stats = registration.statistics()
        assert stats.registrations == 1 and stats.heartbeats == 24 and stats.failures == 0
        assert meta.statistics().registry.servers == 1


async def test_start_registration_registers_a_master_with_the_software_version(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        registration = await start_registration(
            nursery, network, group="s1", kind=ServerKind.SCHEDULER, address="10.0.0.2:20882",
            meta_address=[META], clock=metaservers.clock,
        )  # fmt: skip
        assert registration.registered and registration.is_master
        status = (await network.call(META, Command.STATUS)).metadata
        assert [(row["group"], row["kind"], row["role"], row["address"], row["version"]) for row in status["rows"]] == [
            ("s1", "scheduler", "master", "10.0.0.2:20882", software_version())
        ]
        assert software_version()


async def test_silent_master_is_evicted_on_time_and_back_when_it_heartbeats(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.metaserver")
    async with metaservers.on_network() as (meta, network, nursery):
        async with trio.open_nursery() as agent:
            agent.start_soon(
                partial(run_registration, network, meta_address=META, info=server_info(), clock=metaservers.clock)
            )
            await trio.sleep(12)
            agent.cancel_scope.cancel()
        # The agent beat at +0, +5, +10 s; it is silent from +10 s on.
        version = (await route(network, "consumer"))["version"]
        await metaservers.clock.sleep_until_ms(T0 + 10_000 + 29_999)
        assert await routed(network, "consumer") == ["rt1"]
        await metaservers.clock.sleep_until_ms(T0 + 10_000 + 30_000)
        evicted = await route(network, "consumer")
        assert evicted["groups"] == [] and evicted["version"] > version
        await trio.sleep(1.5)  # the periodic check logs it
        assert "group rt1 evicted: no heartbeat from its master 10.0.0.1:20881 for 30." in caplog.text
        status = (await network.call(META, Command.STATUS)).metadata
        (row,) = status["rows"]
        assert row["evicted"] is True and row["seconds_since_heartbeat"] >= 30

        registration = await metaservers.start_agent(nursery, network, server_info())
        back = await route(network, "consumer")
        assert [g["group"] for g in back["groups"]] == ["rt1"] and back["version"] > evicted["version"]
        assert "group rt1 is back: its master 10.0.0.1:20881 heartbeats" in caplog.text
        assert registration.state == "RW"


async def test_read_only_group_is_left_out_for_producers_and_kept_for_consumers(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.metaserver")
    async with metaservers.on_network() as (meta, network, nursery):
        agents = {}
        for info in (
            server_info("rt1", "r1:1"),
            server_info("rt2", "r2:1"),
            server_info("rt2", "r2b:1", role="slave"),
            server_info("sched1", "s1:1", kind="scheduler"),
        ):
            agents[info["address"]] = await metaservers.start_agent(nursery, network, info)
        answer = (await network.call(META, Command.SET_STATE, {"group": "rt2", "state": "R"})).metadata
        assert answer == {"state": "R", "previous": "RW"}
        assert "group rt2 state changed RW -> R" in caplog.text

        assert await routed(network, "immediate-producer") == ["rt1"]
        assert await routed(network, "scheduler-delivery", "orders") == ["rt1"]
        assert await routed(network, "delayed-producer") == ["sched1"]
        consumer = (await route(network, "consumer"))["groups"]
        assert [(g["group"], g["state"], g["slaves"]) for g in consumer] == [
            ("rt1", "RW", []),
            ("rt2", "R", ["r2b:1"]),
        ]
        await trio.sleep(6)  # the next heartbeat tells the servers of rt2
        assert agents["r2:1"].state == "R" and agents["r2b:1"].state == "R"
        assert agents["r2b:1"].master_address == "r2:1" and not agents["r2b:1"].is_master
        assert agents["r1:1"].state == "RW"


async def test_route_version_moves_only_when_routes_do(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        first = (await network.call(META, Command.REGISTER, server_info("rt1", "r1:1"))).metadata
        answer = await route(network, "immediate-producer")
        assert answer["version"] == first["route_version"]
        await trio.sleep(3)
        beat = (await network.call(META, Command.HEARTBEAT, {"group": "rt1", "address": "r1:1"})).metadata
        assert beat["route_version"] == answer["version"]
        same = await route(network, "immediate-producer", known_version=answer["version"])
        assert same == {"version": answer["version"], "unchanged": True}

        await network.call(META, Command.REGISTER, server_info("rt2", "r2:1"))
        changed = await route(network, "immediate-producer", known_version=answer["version"])
        assert changed["version"] > answer["version"]
        assert [g["group"] for g in changed["groups"]] == ["rt1", "rt2"]


async def test_restarted_metaserver_answers_routes_at_once_from_its_data_folder(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.network() as (network, nursery):
        async with metaservers.serving(network) as meta:
            await network.call(META, Command.REGISTER, server_info("rt1", "r1:1"))
            await network.call(META, Command.REGISTER, server_info("rt2", "r2:1"))
            await network.call(META, Command.REGISTER, server_info("sched1", "s1:1", kind="scheduler"))
            await network.call(META, Command.SET_STATE, {"group": "rt2", "state": "R"})
            before = await route(network, "consumer")
            assert meta.statistics().snapshots_written == 4
        await trio.sleep(600)  # down for ten minutes: longer than any eviction
        async with metaservers.serving(network) as meta:
            after = await route(network, "consumer")
            assert after["groups"] == before["groups"]  # at once, state R kept
            assert after["version"] > before["version"]
            assert await routed(network, "immediate-producer") == ["rt1"]
            assert await routed(network, "delayed-producer") == ["sched1"]
            assert meta.statistics().restored_servers == 3
            # A restored server heartbeats without registering again...
            await trio.sleep(20)
            await network.call(META, Command.HEARTBEAT, {"group": "rt1", "address": "r1:1"})
            # ...and those that never come back drop out after one eviction timeout.
            await trio.sleep(15)
            assert await routed(network, "consumer") == ["rt1"]


# -- the agent through outages and refusals ---------------------------------------------------


async def test_agent_rides_out_an_outage_logging_once_and_registers_again(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.client.registration")
    async with metaservers.network() as (network, nursery):
        async with metaservers.serving(network, "a"):
            registration: Registration = await metaservers.start_agent(nursery, network, server_info())
        network.take_down(META)
        calls_before = network.calls[META]
        await trio.sleep(60)
        stats = registration.statistics()
        assert network.calls[META] - calls_before > 10  # it kept trying...
        assert stats.outages == 1 and stats.failures > 10 and not stats.registered
        assert caplog.text.count("metaserver meta:20880 unreachable") == 1  # ...and said so once
        # The metaserver comes back without its data: the agent registers again.
        async with metaservers.serving(network, "b"):
            await trio.sleep(6)
            assert registration.registered and registration.statistics().registrations == 2
            assert "metaserver meta:20880 answers again after" in caplog.text
            assert await routed(network, "consumer") == ["rt1"]
            network.take_down(META)


async def test_metaserver_that_forgot_the_server_gets_it_registered_again(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.network() as (network, nursery):
        async with metaservers.serving(network, "a"):
            registration: Registration = await metaservers.start_agent(nursery, network, server_info())
            with pytest.raises(PeerError) as unknown:
                await network.call(META, Command.HEARTBEAT, {"group": "rt1", "address": "10.9.9.9:1"})
            assert unknown.value.code == "register_first" and unknown.value.field == "address"
        async with metaservers.serving(network, "b"):  # swapped with no outage
            await trio.sleep(6)  # its next heartbeat (+5 s) is answered register_first
            stats = registration.statistics()
            assert stats.registrations == 2 and stats.failures == 0 and stats.outages == 0
            assert await routed(network, "consumer") == ["rt1"]
            network.take_down(META)


async def test_first_registration_refused_stops_the_server(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        await network.call(META, Command.REGISTER, server_info("g1", "a:1", kind="scheduler"))
        with pytest.raises(RegistrationRefused, match="group 'g1' is a scheduler group"):
            await metaservers.start_agent(nursery, network, server_info("g1", "b:1"))


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, metadata, code, field, words",
    [
        (Command.REGISTER, {"group": "rt1"}, "bad_request", "kind", "field 'kind' is missing"),
        (Command.REGISTER, {**server_info(), "group": 7}, "bad_request", "group", "must be str, got int"),
        (Command.REGISTER, {**server_info(), "role": "boss"}, "bad_request", "role", "unknown role 'boss'"),
        (Command.REGISTER, {**server_info(), "address": "nohost"}, "bad_request", "address", "not host:port"),
        (Command.REGISTER, {**server_info(), "version": "x" * 65}, "bad_request", "version", "limit 64"),
        (Command.HEARTBEAT, {"group": "rt1"}, "bad_request", "address", "field 'address' is missing"),
        (Command.HEARTBEAT, {"group": "nope", "address": "a:1"}, "register_first", "group", "send REGISTER"),
        (Command.ROUTE, {}, "bad_request", "route", "field 'route' is missing"),
        (Command.ROUTE, {"route": "everything"}, "bad_request", "route", "unknown route 'everything'"),
        (Command.ROUTE, {"route": "scheduler-delivery"}, "bad_request", "subject", "must be a string"),
        (Command.ROUTE, {"route": "consumer", "known_version": "1"}, "bad_request", "known_version", "must be int"),
        (Command.SET_STATE, {"group": "nope", "state": "R"}, "bad_request", "group", "unknown group 'nope'"),
        (Command.SET_STATE, {"group": "rt1", "state": "RO"}, "bad_request", "state", "unknown state 'RO'"),
        (999, {}, "bad_request", "command", "unknown command UNKNOWN(999)"),
    ],
)
async def test_bad_requests_are_refused_naming_the_field(
    autojump_clock: trio.testing.MockClock,
    metaservers: Any,
    command: int,
    metadata: dict[str, Any],
    code: str,
    field: str,
    words: str,
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        await network.call(META, Command.REGISTER, server_info())
        with pytest.raises(PeerError) as refused:
            await network.call(META, command, metadata)
        assert (refused.value.code, refused.value.field) == (code, field)
        assert words in str(refused.value)
        assert await routed(network, "consumer") == ["rt1"]  # and it goes on serving


def _raw_exchange(address: str, data: bytes) -> tuple[list[Frame], bool]:
    """Send raw bytes; the frames answered and whether the server then closed."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        decoder = FrameDecoder()
        frames: list[Frame] = []
        while not frames:
            chunk = sock.recv(65536)
            if not chunk:
                return frames, True
            decoder.feed(chunk)
            frames.extend(decoder)
        sock.settimeout(0.2)
        try:
            closed = sock.recv(65536) == b""
        except TimeoutError:
            closed = False
        return frames, closed


@pytest.mark.parametrize(
    "payload, code, closes",
    [
        (b"\x00\x01garbage bytes, not a frame" * 4, "bad_magic", True),
        (struct.pack(">2sBBHIII", b"DQ", 1, 0, Command.ROUTE, 5, 0, 1_000_000), "oversize", True),
        (struct.pack(">2sBBHIII", b"DQ", 1, 0, Command.ROUTE, 6, 1, 0) + b"\xc1", "bad_metadata", False),
        (encode_frame(request(Command.REGISTER, 7, {"group": "rt9", "kind": 3})), "bad_request", False),
        (encode_frame(request(4242, 8)), "bad_request", False),
    ],
)
async def test_loopback_abuse_is_answered_while_a_good_client_is_served(
    tmp_path: Path, payload: bytes, code: str, closes: bool
) -> None:
    limits = Limits(max_frame=64 * 1024)
    async with open_metaserver(data_dir=tmp_path, clock=SystemClock(), limits=limits) as meta:
        assert meta.address is not None
        async with open_peers(limits=limits) as peers, trio.open_nursery() as nursery:
            await peers.call(meta.address, Command.REGISTER, server_info("rt1", "127.0.0.1:9"))
            answers: list[list[str]] = []
            abuse_done = trio.Event()

            async def good_client() -> None:
                # Keeps asking until the abuse is over, then once more.
                while True:
                    done = abuse_done.is_set()
                    frame = await peers.call(meta.address, Command.ROUTE, {"route": "consumer"})
                    answers.append([g["group"] for g in frame.metadata["groups"]])
                    if done:
                        return
                    await trio.sleep(0.005)

            nursery.start_soon(good_client)
            frames, closed = await trio.to_thread.run_sync(_raw_exchange, meta.address, payload)
            abuse_done.set()
        (answer,) = frames
        assert answer.metadata["error"]["code"] == code
        assert closed == closes
        assert answers and all(groups == ["rt1"] for groups in answers)
        assert meta.statistics().transport.errors_answered == 1
