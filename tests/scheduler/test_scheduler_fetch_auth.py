"""FETCH on a scheduler with a tokens file: only a token that may be a server of this
scheduler group gets its message log (docs/replication.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.clock import TrioClock
from delaymq.net.auth import FORBIDDEN, TokenFile
from delaymq.net.limits import Limits
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import encode_message
from delaymq.replication.wire import FetchRequest
from delaymq.scheduler.server import open_scheduler
from delaymq.storage.threads import run_inline

from ..support.tokens import PRODUCER, SHOP_TOKEN, token, tokens_toml

EPOCH_MS = 1_749_996_000_000
ADDRESS = "sched.test:1"
GROUP = "sched-1"
OWN_GROUP = "own-group-secret-0123456789"
OTHER_GROUP = "other-group-secret-0123456789"
TOKENS = tokens_toml(
    SHOP_TOKEN,
    token("sched-1-member", OWN_GROUP, ["server"], servers=[f"scheduler:{GROUP}"]),
    token("sched-2-member", OTHER_GROUP, ["server"], servers=["scheduler:sched-2", "realtime:*"]),
)


async def fetch_as(nursery: trio.Nursery, scheduler: Any, token: str) -> tuple[dict[str, Any], bytes]:
    """FETCH from offset 0 on a connection of its own that presented ``token``."""
    net = MemoryNetwork(nursery)
    net.serve(ADDRESS, scheduler.serve_stream)
    await net.call(ADDRESS, Command.AUTH, {"token": token})
    request = FetchRequest(group=GROUP, address="fake-slave.test:1", epoch=0, offset=0, last_epoch=0)
    frame = await net.call(ADDRESS, Command.FETCH, request.as_metadata())
    return frame.metadata, frame.body


async def test_fetch_with_a_token_of_another_group_is_forbidden_and_gets_no_bytes(
    tmp_path: Path, autojump_clock: Any
) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    clock = TrioClock(EPOCH_MS)
    async with open_scheduler(
        data_dir=tmp_path / "sched", clock=clock, listen=None, group=GROUP, run_blocking=run_inline,
        limits=Limits(tokens=TokenFile(tokens)),
    ) as scheduler:  # fmt: skip
        async with trio.open_nursery() as nursery:
            net = MemoryNetwork(nursery)
            net.serve(ADDRESS, scheduler.serve_stream)
            await net.call(ADDRESS, Command.AUTH, {"token": PRODUCER})
            record = encode_message("m1", "orders", body=b"secret body", deliver_at=EPOCH_MS + 60_000)
            stored = await net.call(ADDRESS, Command.SCHEDULE, {}, record)
            assert stored.metadata["results"] == ["scheduled"]

            with pytest.raises(PeerError) as refused:
                await fetch_as(nursery, scheduler, OTHER_GROUP)
            assert refused.value.code == FORBIDDEN
            assert f"scheduler:{GROUP}" in str(refused.value)
            assert "secret body" not in str(refused.value)
            assert scheduler.statistics().replication["replicas"] == []  # no slave was registered either

            _answer, body = await fetch_as(nursery, scheduler, OWN_GROUP)
            assert b"secret body" in body  # the group's own member token is served
            nursery.cancel_scope.cancel()
