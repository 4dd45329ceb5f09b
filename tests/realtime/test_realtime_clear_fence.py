"""CLEAR_FENCE: an admin makes realtime servers forget a scheduler group's fence, durably, on the
master and (through replication) on its slaves; ``delaymq admin clear-fence`` sends it to the
master of every realtime group."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.cli.main import main
from delaymq.net.auth import FORBIDDEN, UNAUTHORIZED, TokenFile
from delaymq.net.limits import Limits
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.fencing import FENCED, Fence
from delaymq.protocol.records import encode_batch

from ..conftest import open_local_servers
from ..support.polling import wait_until
from .test_realtime_abuse import ADMIN, PRODUCER, SCHEDULER, SERVER, TOKENS, WAIT, Secured, message, open_secured
from .test_realtime_replication import A, B, C, open_cluster


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return path


async def fenced_send(rt: Secured, epoch: int, message_id: str) -> list[str]:
    return await rt.send(SCHEDULER, [message(message_id, "orders")], **Fence("sched-1", epoch).as_metadata())


async def test_only_an_admin_clears_a_fence_and_the_group_sets_it_again(
    tmp_path: Path, tokens: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_secured(tmp_path, tokens) as rt:
        epoch = rt.server.member.clock.now_ms()
        assert await fenced_send(rt, epoch, "m1") == ["stored"]
        older = Fence("sched-1", epoch - 10).as_metadata()
        assert (
            await rt.refused(SCHEDULER, Command.SEND, older, encode_batch([message("m2", "orders")]))
        ).code == FENCED
        for token, code, words in [
            (SCHEDULER, FORBIDDEN, "role admin needed for CLEAR_FENCE"),
            (PRODUCER, FORBIDDEN, "role admin needed for CLEAR_FENCE"),
            (None, UNAUTHORIZED, "no token"),
        ]:
            error = await rt.refused(token, Command.CLEAR_FENCE, {"group": "sched-1"})
            assert error.code == code and words in error.message
        for metadata, field in [({}, "group"), ({"group": "a b"}, "group"), ({"group": "sched-1", "to": 1}, "to")]:
            error = await rt.refused(ADMIN, Command.CLEAR_FENCE, metadata)
            assert (error.code, error.field) == ("bad_request", field)
        assert (await rt.status())["fences"] == {"sched-1": epoch}  # nothing changed
        with caplog.at_level(logging.WARNING, logger="delaymq.realtime"):
            answer = (await rt.call(ADMIN, Command.CLEAR_FENCE, {"group": "sched-1"})).metadata
        assert answer == {"group": "sched-1", "cleared": epoch}
        [line] = [r.getMessage() for r in caplog.records if "cleared" in r.getMessage()]
        assert "sched-1" in line and f"epoch {epoch}" in line and "token 'ops'" in line
        assert (await rt.status())["fences"] == {}
        assert await fenced_send(rt, epoch - 10, "m3") == ["stored"]  # the group's next SEND sets it again
        unknown = (await rt.call(ADMIN, Command.CLEAR_FENCE, {"group": "sched-2"})).metadata
        assert unknown == {"group": "sched-2", "cleared": None}
    async with open_secured(tmp_path, tokens) as rt:  # durable
        assert (await rt.status())["fences"] == {"sched-1": epoch - 10}


async def test_a_fence_cleared_on_the_master_is_cleared_on_its_slaves(tmp_path: Path, autojump_clock: Any) -> None:
    async def fences(address: str) -> dict[str, int]:
        table: dict[str, int] = (await cluster.net.call(address, Command.STATUS, {})).metadata["fences"]
        return table

    async with open_cluster(tmp_path) as cluster:
        master, slave = await cluster.pair(min_insync=1)
        third = await cluster.start(C, min_insync=1)
        await wait_until(lambda: third.role == "slave" and master.replica_info().get("in_sync") == [B, C])
        high = Fence("scheduler-1", 7).as_metadata()
        assert await cluster.send(A, ["f1"], **high) == ["stored"]
        for address in (B, C):
            with trio.fail_after(60):
                while await fences(address) != {"scheduler-1": 7}:
                    await trio.sleep(0.05)
        with pytest.raises(PeerError) as refused:
            await cluster.net.call(B, Command.CLEAR_FENCE, {"group": "scheduler-1"})
        assert refused.value.code == "not_master"
        answer = await cluster.net.call(A, Command.CLEAR_FENCE, {"group": "scheduler-1"})
        assert answer.metadata == {"group": "scheduler-1", "cleared": 7}
        for address in (A, B, C):
            with trio.fail_after(60):
                while await fences(address) != {}:
                    await trio.sleep(0.05)
        cluster.kill(A)
        await wait_until(lambda: slave.role == "master" and slave.replica_info().get("in_sync") == [C])
        assert await cluster.send(B, ["f2"], **Fence("scheduler-1", 3).as_metadata()) == ["stored"]


async def test_admin_clear_fence_asks_every_realtime_master(
    tmp_path: Path, tokens: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    limits = Limits(tokens=TokenFile(tokens), token=SERVER)
    async with open_local_servers(tmp_path, limits, wait=WAIT) as servers:
        rt = Secured(servers.realtime, tmp_path / "rt")
        where = f"realtime {rt.server.group} at {rt.server.address}"
        epoch = rt.server.member.clock.now_ms()
        assert await fenced_send(rt, epoch, "m1") == ["stored"]

        async def admin(*argv: str) -> int:
            code: int = await trio.to_thread.run_sync(main, ["admin", "clear-fence", *argv, "--timeout", "20s"])
            return code

        assert await admin("sched-1", "--meta", servers.address, "--token", ADMIN) == 0
        assert f"{where}: fence of scheduler group sched-1 cleared (it was at epoch {epoch})" in capsys.readouterr().out
        assert (await rt.status())["fences"] == {}
        assert await admin("sched-1", "--realtime", str(rt.server.address), "--token", ADMIN) == 0
        assert "held no fence of scheduler group sched-1" in capsys.readouterr().out
        assert await fenced_send(rt, epoch, "m2") == ["stored"]
        assert await admin("sched-1", "--meta", servers.address, "--token", SERVER) == 1
        err = capsys.readouterr().err
        assert f"{where} refused" in err and "role admin needed for CLEAR_FENCE" in err
        assert (await rt.status())["fences"] == {"sched-1": epoch}
