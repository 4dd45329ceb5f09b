"""The shared transport: requests answered, bad input refused, others unharmed."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from delaymq.net.connection import Connection, PeerUnavailable, RequestTimeout
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.frames import FrameDecoder, FrameKind, encode_frame, request


async def echo(req: Request) -> tuple[dict, bytes]:
    if req.metadata.get("sleep"):
        await trio.sleep(req.metadata["sleep"])
    if req.metadata.get("boom"):
        raise RuntimeError("handler bug")
    return {"echo": req.metadata.get("value")}, req.body


def make_server(**options: object) -> FrameServer:
    return FrameServer({Command.PING: echo}, **options)  # type: ignore[arg-type]


async def test_requests_on_one_connection_run_concurrently(autojump_clock: trio.testing.MockClock) -> None:
    server = make_server()
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = Connection("memory", client_end, limits=Limits())
    results: dict[int, float] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_end)
        nursery.start_soon(connection.read_responses)

        async def call(value: int, sleep: float) -> None:
            frame = await connection.call(Command.PING, {"value": value, "sleep": sleep}, timeout=60)
            assert frame.metadata == {"echo": value}
            results[value] = trio.current_time()

        start = trio.current_time()
        async with trio.open_nursery() as calls:
            calls.start_soon(call, 1, 30.0)  # a slow request (a long poll)...
            calls.start_soon(call, 2, 0.0)  # ...does not hold up the one behind it
        assert results[2] - start < 1 < results[1] - start
        nursery.cancel_scope.cancel()


async def test_request_timeout_names_command_and_peer(autojump_clock: trio.testing.MockClock) -> None:
    server = make_server()
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = Connection("memory", client_end, limits=Limits())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_end)
        nursery.start_soon(connection.read_responses)
        with pytest.raises(RequestTimeout, match="PING to memory got no answer within 5 s"):
            await connection.call(Command.PING, {"sleep": 100}, timeout=5)
        # The connection is still good for the next request.
        frame = await connection.call(Command.PING, {"value": "x"}, timeout=5)
        assert frame.metadata == {"echo": "x"}
        nursery.cancel_scope.cancel()


async def test_loopback_unknown_command_and_handler_bug_answered_with_errors() -> None:
    server = make_server()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)
        async with open_peers() as peers:
            frame = await peers.call(address, Command.PING, {"value": 7}, b"body")
            assert (frame.metadata, frame.body) == ({"echo": 7}, b"body")
            with pytest.raises(PeerError) as unknown:
                await peers.call(address, 999)
            assert unknown.value.code == "bad_request" and unknown.value.field == "command"
            assert "UNKNOWN(999)" in str(unknown.value)
            with pytest.raises(PeerError) as bug:
                await peers.call(address, Command.PING, {"boom": True})
            assert bug.value.code == "internal"
            # Same connection, still serving.
            frame = await peers.call(address, Command.PING, {"value": 8})
            assert frame.metadata == {"echo": 8}
            assert peers.statistics().connects == 1
        nursery.cancel_scope.cancel()


def raw_exchange(address: str, data: bytes, *, read_until_close: bool) -> tuple[list, bool]:
    """Send raw bytes, return the frames answered and whether the server closed."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        decoder = FrameDecoder()
        frames: list = []
        closed = False
        while True:
            if not read_until_close and frames:
                break
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            decoder.feed(chunk)
            frames.extend(decoder)
        return frames, closed


def bad_metadata_frame(request_id: int) -> bytes:
    meta = b"\xc1"  # never valid msgpack
    return struct.pack(">2sBBHIII", b"DQ", 1, 0, Command.PING, request_id, len(meta), 0) + meta


@pytest.mark.parametrize(
    "payload, code, closes",
    [
        (b"GET / HTTP/1.1\r\n\r\n", "bad_magic", True),
        (struct.pack(">2sBBHIII", b"DQ", 9, 0, 1, 5, 0, 0), "unknown_version", True),
        (struct.pack(">2sBBHIII", b"DQ", 1, 0, 1, 5, 0, 2_000_000), "oversize", True),
        (bad_metadata_frame(42), "bad_metadata", False),
        (encode_frame(request(999, 43, {"x": 1})), "bad_request", False),
    ],
)
async def test_bad_bytes_answered_while_a_good_client_is_served(payload: bytes, code: str, closes: bool) -> None:
    server = make_server(limits=Limits(max_frame=1_000_000))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)
        async with open_peers() as peers:
            # A well-behaved client with a request in flight during the abuse.
            slow = trio.Event()

            async def good_client() -> None:
                frame = await peers.call(address, Command.PING, {"value": "ok", "sleep": 0.2})
                assert frame.metadata == {"echo": "ok"}
                slow.set()

            nursery.start_soon(good_client)
            frames, closed = await trio.to_thread.run_sync(
                lambda: raw_exchange(address, payload, read_until_close=closes)
            )
            assert closed == closes
            (answer,) = frames
            assert answer.kind == FrameKind.RESPONSE
            assert answer.metadata["error"]["code"] == code
            await slow.wait()
            frame = await peers.call(address, Command.PING, {"value": "after"})
            assert frame.metadata == {"echo": "after"}
        nursery.cancel_scope.cancel()


async def test_non_fatal_error_keeps_the_connection_in_sync() -> None:
    server = make_server()
    good = encode_frame(request(Command.PING, 44, {"value": "next"}))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)

        def exchange() -> list:
            host, port = address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(bad_metadata_frame(43) + good)
                decoder = FrameDecoder()
                frames: list = []
                while len(frames) < 2:
                    decoder.feed(sock.recv(65536))
                    frames.extend(decoder)
                return frames

        frames = await trio.to_thread.run_sync(exchange)
        by_id = {frame.request_id: frame for frame in frames}
        assert by_id[43].metadata["error"]["code"] == "bad_metadata"
        assert by_id[44].metadata == {"echo": "next"}
        nursery.cancel_scope.cancel()


async def test_unreachable_peer_backs_off_then_reconnects() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens on this port now
    address = f"127.0.0.1:{port}"
    async with open_peers(backoff_initial=30, backoff_max=60) as peers:
        with pytest.raises(PeerUnavailable, match="cannot connect"):
            await peers.call(address, Command.PING)
        with pytest.raises(PeerUnavailable, match="next attempt in"):
            await peers.call(address, Command.PING)
        assert peers.statistics().connect_failures == 1


async def test_connection_reused_and_redialled_after_server_restart() -> None:
    async with open_peers(backoff_initial=0.0) as peers:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(make_server().serve)
            await peers.call(address, Command.PING)
            await peers.call(address, Command.PING)
            assert peers.statistics().connects == 1
            nursery.cancel_scope.cancel()
        host, port = address.rsplit(":", 1)
        async with trio.open_nursery() as nursery:
            await nursery.start(make_server().serve, host, int(port))
            try:
                frame = await peers.call(address, Command.PING, {"value": 2})
            except PeerUnavailable:  # the old connection died under this call
                frame = await peers.call(address, Command.PING, {"value": 2})
            assert frame.metadata == {"echo": 2}
            assert peers.statistics().connects == 2
            nursery.cancel_scope.cancel()


async def test_a_closed_connection_cancels_its_waiting_handlers() -> None:
    cancelled = trio.Event()
    entered = trio.Event()

    async def long_poll(req: Request) -> dict:
        try:
            entered.set()
            await trio.sleep_forever()
        finally:
            cancelled.set()

    server = FrameServer({Command.PULL: long_poll})
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)
        async with open_peers() as peers:

            async def waiting_consumer() -> None:
                with pytest.raises(PeerUnavailable):
                    await peers.call(address, Command.PULL, timeout=600)

            nursery.start_soon(waiting_consumer)
            await entered.wait()
        # open_peers closed the connection; the server notices and cancels the poll.
        with trio.fail_after(10):  # a guard against hanging, not a synchronisation
            await cancelled.wait()
        assert server.statistics().connections_open == 0
        nursery.cancel_scope.cancel()


async def test_a_server_without_a_ping_handler_answers_ping_and_refuses_an_unknown_command(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client probes a busy connection it hears nothing on with PING: every server answers it."""
    server = FrameServer({Command.SEND: echo})
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = Connection("memory", client_end, limits=Limits())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_end)
        nursery.start_soon(connection.read_responses)
        answer = await connection.call(Command.PING, {}, timeout=5)
        assert (answer.metadata, answer.body) == ({}, b"")
        with pytest.raises(PeerError) as refused:
            await connection.call(Command.PULL, {}, timeout=5)
        assert refused.value.code == "bad_request" and "unknown command PULL" in str(refused.value)
        nursery.cancel_scope.cancel()
