"""Who may speak for a server or change a group, against a metaserver with a tokens file.

The metaserver serves on loopback with the real trio clock for its I/O, and reads
its time from a ``ManualClock`` the test moves: an eviction is a step of that
clock, never a sleep. Each refusal is checked from the attacker's side (the code
and words it is answered) and from everyone else's (routes, STATUS, the stored
snapshot: unchanged). The registry's rules for a member id are checked sans-IO too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.metaserver.registry import MemberTaken, Registry, Role
from delaymq.metaserver.server import Metaserver, open_metaserver
from delaymq.net.auth import FORBIDDEN, TokenFile
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.storage.threads import run_inline

from ..support.tokens import PRODUCER, SHOP_TOKEN, token, tokens_toml

T0 = 1_700_000_000_000
EVICT_MS = 30_000
WAIT = 10.0

RT1 = "rt1-secret-0123456789"
RT2 = "rt2-secret-0123456789"
SCHED = "sched-secret-0123456789"
SCHED_OTHER = "sched-other-secret-0123456789"
OPS = "ops-secret-0123456789"

TOKENS = tokens_toml(
    token("rt-1", RT1, ["server"], servers=["realtime:rt-1"]),
    token("rt-2", RT2, ["server"], servers=["realtime:rt-2"]),
    token("sched", SCHED, ["server"], servers=["scheduler:sched-1"]),
    token("sched-other", SCHED_OTHER, ["server"], servers=["scheduler:sched-*"]),
    SHOP_TOKEN,
    token("ops", OPS, ["admin"]),
)

REAL, SLAVE, ROGUE = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:6666"


class ManualClock:
    """The metaserver's clock: it moves only when the test calls ``advance``."""

    def __init__(self, epoch_ms: int) -> None:
        self._epoch_ms = epoch_ms
        self._elapsed_ms = 0
        self._moved = trio.Event()

    def now_ms(self) -> int:
        return self._epoch_ms + self._elapsed_ms

    def monotonic_ms(self) -> int:
        return self._elapsed_ms

    def advance(self, delta_ms: int) -> None:
        self._elapsed_ms += delta_ms
        self._moved.set()
        self._moved = trio.Event()

    async def sleep_until_ms(self, epoch_ms: int) -> None:
        while self.now_ms() < epoch_ms:
            await self._moved.wait()

    async def sleep_ms(self, duration_ms: float) -> None:
        await self.sleep_until_ms(self.now_ms() + max(0, int(duration_ms)))


@asynccontextmanager
async def serving(tmp_path: Path, clock: ManualClock) -> AsyncIterator[Metaserver]:
    """A metaserver on loopback that checks every request against the tokens file."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    async with open_metaserver(
        listen="127.0.0.1:0",
        data_dir=tmp_path / "meta",
        clock=clock,
        limits=Limits(tokens=TokenFile(tokens)),
        evict_after_ms=EVICT_MS,
        failover_after_ms=EVICT_MS,  # a member is live for both (the shorter counts)
        run_blocking=run_inline,
    ) as meta:
        yield meta


async def call(meta: Metaserver, token: str, command: Command, metadata: dict[str, Any]) -> dict[str, Any]:
    async with open_peers(limits=Limits(token=token)) as peers:
        frame = await peers.call(meta.address or "", command, metadata, timeout=WAIT)
    return dict(frame.metadata)


async def refused(meta: Metaserver, token: str, command: Command, metadata: dict[str, Any]) -> PeerError:
    with pytest.raises(PeerError) as error:
        await call(meta, token, command, metadata)
    return error.value


async def view(meta: Metaserver) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What any client sees: the routes of both kinds of group, and STATUS's rows."""
    routes = []
    for route in ("immediate-producer", "delayed-producer"):
        routes += (await call(meta, OPS, Command.ROUTE, {"route": route}))["groups"]
    return routes, (await call(meta, OPS, Command.STATUS, {}))["rows"]


def realtime(address: str, group: str = "rt-1") -> dict[str, Any]:
    return {"group": group, "kind": "realtime", "role": "master", "address": address, "version": "0.1.0"}


def scheduler(address: str, incarnation: str, member: str = "folder-a") -> dict[str, Any]:
    return {
        "group": "sched-1",
        "kind": "scheduler",
        "role": "master",
        "address": address,
        "version": "0.1.0",
        "incarnation": incarnation,
        "member": member,
        "replica": {"offset": 0, "epoch": 0},
    }


# -- a server token speaks only for its own kind:group ------------------------------------


async def test_a_token_for_another_group_can_neither_register_nor_heartbeat_as_it(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    async with serving(tmp_path, clock) as meta:
        await call(meta, RT1, Command.REGISTER, realtime(REAL))
        clock.advance(10_000)  # the real server has been silent 10 s
        before = await view(meta)
        written = meta.statistics().snapshots_written

        taken = await refused(meta, RT2, Command.REGISTER, realtime(ROGUE))
        assert (taken.code, taken.field) == (FORBIDDEN, "servers")
        assert "may not act as server realtime:rt-1" in str(taken)
        for address in (REAL, ROGUE):  # a registered address or not: the same refusal
            beat = await refused(meta, RT2, Command.HEARTBEAT, {"group": "rt-1", "address": address})
            assert (beat.code, beat.field) == (FORBIDDEN, "servers")
            assert "token 'rt-2' may not act as server realtime:rt-1" in str(beat)

        assert await view(meta) == before  # still routed to REAL, still silent for 10 s
        assert before[0][0]["address"] == REAL and before[1][0]["seconds_since_heartbeat"] == 10.0
        assert meta.statistics().snapshots_written == written
        # The group's own token still heartbeats it.
        assert (await call(meta, RT1, Command.HEARTBEAT, {"group": "rt-1", "address": REAL}))["master"] == REAL


async def test_a_heartbeat_for_an_unknown_group_is_told_to_register(tmp_path: Path) -> None:
    async with serving(tmp_path, ManualClock(T0)) as meta:
        error = await refused(meta, RT2, Command.HEARTBEAT, {"group": "rt-1", "address": ROGUE})
        assert error.code == "register_first"
        assert await view(meta) == ([], [])


# -- a member id belongs to the run that registered it ------------------------------------


async def test_a_live_member_id_cannot_be_taken_at_another_address(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    async with serving(tmp_path, clock) as meta:
        await call(meta, SCHED, Command.REGISTER, scheduler(REAL, "run-a"))
        (row,) = (await call(meta, SCHED_OTHER, Command.STATUS, {}))["rows"]
        assert row["member"] == "folder-a"  # anyone may read it
        clock.advance(EVICT_MS - 1)  # silent, but not yet evicted
        before = await view(meta)
        written = meta.statistics().snapshots_written

        error = await refused(meta, SCHED_OTHER, Command.REGISTER, scheduler(ROGUE, "rogue"))
        assert (error.code, error.field) == ("member_taken", "member")
        assert str(error).startswith("REGISTER: member 'folder-a' of group 'sched-1' is live at " + REAL)
        for words in (
            f"{ROGUE} may not take its place",
            f"stop the process at {REAL}",
            "wait until it has been silent",
        ):
            assert words in str(error), error
        assert await view(meta) == before
        assert before[0][0]["address"] == REAL
        assert meta.statistics().snapshots_written == written

        # The real member stops heartbeating and is evicted: its folder may register elsewhere.
        clock.advance(1)
        reply = await call(meta, SCHED, Command.REGISTER, scheduler(ROGUE, "run-b"))
        assert (reply["role"], reply["master"]) == ("master", ROGUE)
        routes, rows = await view(meta)
        assert [group["address"] for group in routes] == [ROGUE]
        assert [(row["address"], row["member"]) for row in rows] == [(ROGUE, "folder-a")]


async def test_a_member_restarting_at_its_address_or_after_a_metaserver_restart_registers(
    tmp_path: Path,
) -> None:
    clock = ManualClock(T0)
    async with serving(tmp_path, clock) as meta:
        first = await call(meta, SCHED, Command.REGISTER, scheduler(REAL, "run-a"))
        clock.advance(1_000)
        restarted = await call(meta, SCHED, Command.REGISTER, scheduler(REAL, "run-b"))  # a new run, same address
        assert restarted["role"] == "master" and restarted["epoch"] > first["epoch"]
    async with serving(tmp_path, clock) as meta:  # restored from its data folder: every server live again
        error = await refused(meta, SCHED_OTHER, Command.REGISTER, scheduler(ROGUE, "rogue"))
        assert error.code == "member_taken"
        again = await call(meta, SCHED, Command.REGISTER, scheduler(REAL, "run-b"))
        assert (again["role"], again["master"], again["epoch"]) == ("master", REAL, restarted["epoch"])


# -- admin commands -------------------------------------------------------------------------


async def test_only_an_admin_sets_a_state_and_the_log_names_its_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.metaserver")
    async with serving(tmp_path, ManualClock(T0)) as meta:
        await call(meta, RT1, Command.REGISTER, realtime(REAL))
        error = await refused(meta, PRODUCER, Command.SET_STATE, {"group": "rt-1", "state": "NRW"})
        assert (error.code, error.field) == (FORBIDDEN, "role")
        assert "role admin" in str(error) and "needed for SET_STATE; token 'shop' has producer" in str(error)
        other = await refused(meta, RT2, Command.SET_STATE, {"group": "rt-1", "state": "NRW"})
        assert other.code == FORBIDDEN and "'rt-2'" in str(other)  # another group's server token
        assert [row["state"] for row in (await view(meta))[1]] == ["RW"]

        answer = await call(meta, OPS, Command.SET_STATE, {"group": "rt-1", "state": "R"})
        assert answer == {"state": "R", "previous": "RW"}
        assert [row["state"] for row in (await view(meta))[1]] == ["R"]
    lines = [r.getMessage() for r in caplog.records if "state changed" in r.getMessage()]
    assert len(lines) == 1 and "asked by 'ops' from 127.0.0.1:" in lines[0], lines


async def test_a_handover_log_names_the_admin_token(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.metaserver")
    async with serving(tmp_path, ManualClock(T0)) as meta:
        epoch = (await call(meta, SCHED, Command.REGISTER, scheduler(REAL, "run-a")))["epoch"]
        await call(meta, SCHED, Command.REGISTER, scheduler(SLAVE, "run-b", member="folder-b"))
        report = {"offset": 0, "epoch": epoch, "mode": "sync", "in_sync": [SLAVE]}
        await call(meta, SCHED, Command.HEARTBEAT, {"group": "sched-1", "address": REAL, "replica": report})
        answer = await call(meta, OPS, Command.HANDOVER, {"group": "sched-1"})
        assert (answer["from"], answer["to"]) == (REAL, SLAVE)
    lines = [r.getMessage() for r in caplog.records if "handover from master" in r.getMessage()]
    assert len(lines) == 1 and "asked by 'ops' from 127.0.0.1:" in lines[0], lines


# -- the registry's rules for member ids, sans-IO -------------------------------------------


def managed(address: str, incarnation: str | None, member: str = "folder-a") -> dict[str, Any]:
    """``scheduler``'s REGISTER as the registry takes it; ``incarnation`` None: one that does not say."""
    info = {key: value for key, value in scheduler(address, "", member).items() if key != "incarnation"}
    info["software_version"] = info.pop("version")
    return info if incarnation is None else {**info, "incarnation": incarnation}


def test_a_live_member_from_another_run_at_another_address_is_refused_and_nothing_changes() -> None:
    registry = Registry(evict_after_ms=EVICT_MS, failover_after_ms=EVICT_MS)
    registry.register(managed("a:1", "run1"), now_ms=T0)
    registry.register(managed("b:1", "run1", member="folder-b"), now_ms=T0)
    snapshot, changes, version = registry.snapshot(), registry.changes, registry.version
    for incarnation in ("run2", None):  # another run, or one that does not say
        with pytest.raises(MemberTaken) as taken:
            registry.register(managed("c:1", incarnation), now_ms=T0 + EVICT_MS - 1)
        assert taken.value.field == "member" and taken.value.address == "a:1"
    assert (registry.snapshot(), registry.changes, registry.version) == (snapshot, changes, version)


def test_a_member_may_move_in_the_same_run_or_once_its_old_address_is_evicted() -> None:
    registry = Registry(evict_after_ms=EVICT_MS, failover_after_ms=EVICT_MS)
    registry.register(managed("a:1", "run1"), now_ms=T0)
    moved = registry.register(managed("a:2", "run1"), now_ms=T0 + 1_000)  # the same run: its own entry
    assert (moved.role, moved.master) == (Role.MASTER, "a:2")
    later = T0 + 1_000 + EVICT_MS
    restarted = registry.register(managed("a:3", "run2"), now_ms=later)  # evicted: a new run takes the id
    assert (restarted.role, restarted.master) == (Role.MASTER, "a:3")
    assert [(row.address, row.member) for row in registry.status(later)] == [("a:3", "folder-a")]


def test_after_a_restore_the_same_run_registers_and_another_run_elsewhere_waits_for_eviction() -> None:
    registry = Registry(evict_after_ms=EVICT_MS)
    registry.register(managed("a:1", "run1"), now_ms=T0)
    restored = Registry.restore(registry.snapshot(), T0 + 60_000, evict_after_ms=EVICT_MS)
    assert restored.register(managed("a:1", "run1"), now_ms=T0 + 60_001).master == "a:1"
    with pytest.raises(MemberTaken):
        restored.register(managed("a:2", "run2"), now_ms=T0 + 60_002)
    reply = restored.register(managed("a:2", "run2"), now_ms=T0 + 60_001 + EVICT_MS)
    assert reply.master == "a:2"


def test_a_crashed_member_restarted_at_another_address_takes_its_place_after_the_failover_time() -> None:
    """Evicted after 30 s, failed over after 5 s: the restart waits out the shorter, not the eviction."""
    registry = Registry(evict_after_ms=30_000, failover_after_ms=5_000)
    registry.register(managed("a:1", "run1"), now_ms=T0)
    with pytest.raises(MemberTaken):
        registry.register(managed("a:2", "run2"), now_ms=T0 + 4_999)
    registry.register(managed("a:2", "run2"), now_ms=T0 + 5_000)
    assert [row.address for row in registry.status(T0 + 5_000) if not row.evicted] == ["a:2"]
