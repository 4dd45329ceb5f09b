"""A request's timeout is the whole of it: connecting included, and a cut-off send ends the connection."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from delaymq.net.connection import Connection, RequestTimeout
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command


async def test_a_dial_that_hangs_is_bounded_by_the_request_timeout(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def silent_address(*_args: Any, **_kwargs: Any) -> Any:
        await trio.sleep_forever()  # a SYN nobody answers

    monkeypatch.setattr(trio, "open_tcp_stream", silent_address)
    async with open_peers(connect_timeout=5.0) as peers:
        started = trio.current_time()
        with pytest.raises(RequestTimeout, match="no connection within 0.5 s"):
            await peers.call("10.255.255.1:9", Command.PING, timeout=0.5)
        assert trio.current_time() - started == pytest.approx(0.5)
        # A second caller waiting on that same dial is bounded by its own timeout too.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _swallow(peers.call("10.255.255.1:9", Command.PING, timeout=3)))
            await trio.testing.wait_all_tasks_blocked()  # the first caller is dialling
            started = trio.current_time()
            with pytest.raises(RequestTimeout):
                await peers.call("10.255.255.1:9", Command.PING, timeout=0.2)
            assert trio.current_time() - started == pytest.approx(0.2)


async def _swallow(call: Any) -> None:
    with pytest.raises(RequestTimeout):
        await call


async def test_a_send_cut_off_by_its_timeout_ends_the_connection(autojump_clock: trio.testing.MockClock) -> None:
    client_end, _server_end = trio.testing.lockstep_stream_pair()  # nobody reads: the send stalls part way
    connection = Connection("memory", client_end, limits=Limits())
    with pytest.raises(RequestTimeout):
        await connection.call(Command.PING, {}, b"x" * 100_000, timeout=1)
    # Its next request would follow half a frame on the wire: the connection is given up instead.
    assert connection.closed
