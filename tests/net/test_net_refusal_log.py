"""A flood of one refusal is logged as a line a minute with a count, not a line per request."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from delaymq.net.connection import Connection
from delaymq.net.limits import Limits
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError


async def disk_full(_request: Request) -> tuple[dict, bytes]:
    raise RemoteProtocolError("SEND: the disk is full; nothing of it was stored, retry", code="unavailable")


async def test_repeated_refusals_are_logged_once_a_minute_with_a_count(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq")
    server = FrameServer({Command.SEND: disk_full})
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = Connection("memory", client_end, limits=Limits())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_end)
        nursery.start_soon(connection.read_responses)
        for _ in range(3):  # three minutes of a refusal every 100 ms
            for _ in range(600):
                with pytest.raises(PeerError) as refused:
                    await connection.call(Command.SEND, {}, timeout=5)
                assert refused.value.code == "unavailable"  # every client is still told
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused SEND")]
    assert 3 <= len(lines) <= 4, lines  # the first, then one a minute
    assert "(1 such refusal(s)" in lines[0] and "(600 such refusal(s)" in lines[1]
