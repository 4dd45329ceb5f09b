"""serve_frames: the start-up order every server shares, and what its block raises."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from delaymq.net.peers import open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.serving import Task, serve_frames
from delaymq.protocol.commands import Command


async def ping(request: Request) -> dict[str, Any]:
    return {"pong": True}


def background(name: str, events: list[str]) -> Task:
    async def run(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        events.append(f"{name} ready")
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            events.append(f"{name} stopped")

    return run


async def test_tasks_then_the_listener_then_registration_then_the_block() -> None:
    events: list[str] = []

    async def register(nursery: trio.Nursery, address: str) -> None:
        async with open_peers() as peers:  # the listener answers before the metaserver hears of it
            frame = await peers.call(address, Command.PING, {}, b"", timeout=10)
        events.append(f"registered {address}: pong={frame.metadata['pong']}")

    server = FrameServer({Command.PING: ping})
    tasks = [background("first", events), background("second", events)]
    with trio.fail_after(10):
        async with serve_frames(server, bind=("127.0.0.1", 0), tasks=tasks, register=register) as address:
            events.append("block")
    assert address.startswith("127.0.0.1:")
    assert events[:4] == ["first ready", "second ready", f"registered {address}: pong=True", "block"]
    assert sorted(events[4:]) == ["first stopped", "second stopped"]  # all cancelled when the block ends


async def test_without_a_listener_the_advertised_address_registers() -> None:
    registered: list[str] = []

    async def register(nursery: trio.Nursery, address: str) -> None:
        registered.append(address)

    server = FrameServer({Command.PING: ping})
    async with serve_frames(server, bind=None, advertise_address="sched.test:1", register=register) as address:
        assert address == "sched.test:1"
    async with serve_frames(server, bind=None) as address:
        assert address == ""
    assert registered == ["sched.test:1"]


async def test_an_error_in_the_block_comes_out_as_itself_after_the_tasks_stopped() -> None:
    events: list[str] = []
    with pytest.raises(KeyError, match="from the block"):
        async with serve_frames(FrameServer({}), bind=None, tasks=[background("task", events)]):
            raise KeyError("from the block")
    assert events == ["task ready", "task stopped"]
