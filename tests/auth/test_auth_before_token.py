"""What a connection may cost a server before and after its token: small AUTH and PING frames only
until AUTH, metadata capped in size, objects and depth before it is decoded, and a request rate
per token that covers every command.

The decoder's rules are checked sans-IO; a real metaserver with a tokens file is then fed the
frames an attacker would send, on a raw socket, and its memory is read from /proc.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import trio

from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.addresses import parse_address
from delaymq.net.auth import TokenFile
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.net.requests import UNAUTHENTICATED_COMMANDS
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.frames import FRAME_HEADER, MAGIC, VERSION, FrameDecoder, FrameKind, encode_frame, request
from delaymq.protocol.limits import MAX_UNAUTHENTICATED_FRAME

from .conftest import PRODUCER, TOKENS
from .test_auth_limits import SHOP, batch, served, tokens_text

MiB = 1024 * 1024


def raw_frame(command: int, metadata: bytes, *, request_id: int = 7) -> bytes:
    """A request frame with metadata bytes as given: what a hostile client writes by hand."""
    header = FRAME_HEADER.pack(MAGIC, VERSION, FrameKind.REQUEST, command, request_id, len(metadata), 0)
    return header + metadata


def empty_arrays(size: int) -> bytes:
    """A msgpack map of one key holding an array of empty arrays: ``size`` bytes, ~70x that once decoded."""
    count = size - 12
    return b"\x81\xa1x\xdd" + struct.pack(">I", count) + b"\x90" * count


def gated() -> FrameDecoder:
    decoder = FrameDecoder()
    decoder.gate(max_frame=MAX_UNAUTHENTICATED_FRAME, commands=UNAUTHENTICATED_COMMANDS, reason="AUTH takes a token")
    return decoder


def test_before_auth_a_command_other_than_auth_or_ping_is_answered_unauthorized_undecoded() -> None:
    decoder = gated()
    decoder.feed(raw_frame(Command.STATUS, b"\xc1not msgpack at all"))  # never decoded, so never a bad_metadata
    decoder.feed(encode_frame(request(Command.PING, 8)))
    with pytest.raises(RemoteProtocolError) as refused:
        decoder.next_frame()
    assert refused.value.code == "unauthorized" and not refused.value.fatal
    assert refused.value.request_id == 7 and "only AUTH, PING until AUTH takes a token" in str(refused.value)
    ping = decoder.next_frame()
    assert ping is not None and ping.command == Command.PING


def test_before_auth_a_frame_over_64_kib_ends_the_connection_before_its_bytes_arrive() -> None:
    decoder = gated()
    frame = encode_frame(request(Command.AUTH, 1, {"token": "x" * MAX_UNAUTHENTICATED_FRAME}))
    decoder.feed(frame[:100])  # the header is enough to know
    with pytest.raises(RemoteProtocolError) as refused:
        decoder.next_frame()
    assert refused.value.fatal and refused.value.code == "unauthorized"
    assert f"at most {MAX_UNAUTHENTICATED_FRAME}" in str(refused.value)


def test_after_auth_the_gate_is_open() -> None:
    decoder = gated()
    decoder.open_gate()
    decoder.feed(encode_frame(request(Command.STATUS, 3, {"verbose": True})))
    frame = decoder.next_frame()
    assert frame is not None and frame.metadata == {"verbose": True}


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        (empty_arrays(2 * MiB), "holds more than 100000 objects"),
        (b"\x81\xa1x" + b"\x91" * 40 + b"\x90", "nests maps and arrays deeper than 32"),
    ],
    ids=["objects", "depth"],
)
def test_metadata_with_too_many_objects_or_too_deep_is_refused_before_decoding(metadata: bytes, words: str) -> None:
    decoder = FrameDecoder()
    decoder.feed(raw_frame(Command.STATUS, metadata))
    with pytest.raises(RemoteProtocolError) as refused:
        decoder.next_frame()
    assert refused.value.code == "limit" and refused.value.field == "metadata" and not refused.value.fatal
    assert words in str(refused.value)


def test_metadata_over_its_size_limit_is_refused_from_the_header() -> None:
    decoder = FrameDecoder(Limits(max_metadata=1024))
    decoder.feed(encode_frame(request(Command.STATUS, 5, {"x": "y" * 2000})))
    with pytest.raises(RemoteProtocolError) as refused:
        decoder.next_frame()
    assert refused.value.code == "limit" and refused.value.limit == 1024


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


async def read_answer(stream: trio.SocketStream) -> dict:
    decoder = FrameDecoder()
    with trio.fail_after(10):
        while True:
            data = await stream.receive_some(65536)
            assert data, "the server closed without an answer"
            decoder.feed(data)
            frame = decoder.next_frame()
            if frame is not None:
                return frame.metadata["error"]


async def test_a_2_mib_frame_of_empty_arrays_costs_a_metaserver_nothing_with_or_without_a_token(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    limits = Limits(tokens=TokenFile(tokens))
    attack = raw_frame(Command.STATUS, empty_arrays(2 * MiB))
    async with open_metaserver(data_dir=tmp_path / "meta", clock=SystemClock(), limits=limits) as meta:
        host, port = parse_address(meta.address or "")
        before = rss_bytes()
        # no AUTH: told at the header, the connection closed, the frame never buffered
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(attack[:4096])
        error = await read_answer(stream)
        assert error["code"] == "unauthorized" and "before AUTH" in error["message"]
        await stream.aclose()
        # with a token: the frame is read, counted and refused, never decoded
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(encode_frame(request(Command.AUTH, 1, {"token": PRODUCER})))
        await stream.send_all(attack)
        decoder = FrameDecoder()
        answers = []
        with trio.fail_after(10):
            while len(answers) < 2:
                decoder.feed(await stream.receive_some(65536))
                answers += list(decoder)
        assert "error" not in answers[0].metadata
        assert answers[1].metadata["error"]["code"] == "limit"
        assert "more than 100000 objects" in answers[1].metadata["error"]["message"]
        await stream.aclose()
        grown = rss_bytes() - before
        assert grown < 16 * MiB, f"the metaserver grew by {grown / MiB:.0f} MiB"
        # and it still serves
        async with open_peers(limits=Limits(token=PRODUCER)) as peers:
            status = await peers.call(meta.address or "", Command.STATUS, {}, timeout=10)
        assert "rows" in status.metadata


async def test_a_token_over_its_request_rate_is_refused_whatever_the_command(tmp_path: Path) -> None:
    """Trio's mock clock stands still: the bucket of five requests is all there is."""
    text = tokens_text(requests_per_s=5)
    async with served(tmp_path, text) as (server, store, connection):
        outcomes = []
        for command in [Command.SEND, Command.PING, Command.STATUS, Command.ROUTE] * 3:
            try:
                await connection.call(command, {}, batch() if command == Command.SEND else b"", timeout=5)
                outcomes.append("answered")
            except PeerError as error:
                if error.code != "rate_limited":  # served by no handler here: past the token's checks
                    outcomes.append("answered")
                    continue
                assert error.field == "requests_per_s" and "over its rate limit of 5 requests/s" in str(error)
                outcomes.append("rate_limited")
    assert outcomes == ["answered"] * 5 + ["rate_limited"] * 7
    assert store.messages == 2  # the SENDs among the first five, a message each
    assert server.statistics().refused_by_reason["rate_limited"] == 7


def test_a_server_skips_a_response_frame_undecoded() -> None:
    decoder = FrameDecoder(serving=True)
    metadata = empty_arrays(2 * MiB)
    header = FRAME_HEADER.pack(MAGIC, VERSION, FrameKind.RESPONSE, Command.STATUS, 9, len(metadata), 0)
    decoder.feed(header + metadata)
    with pytest.raises(RemoteProtocolError) as refused:
        decoder.next_frame()
    assert refused.value.code == "bad_frame" and refused.value.field == "kind" and not refused.value.fatal


async def test_forbidden_requests_count_against_the_request_rate(tmp_path: Path) -> None:
    """A token flooding requests it may not make is rated like any other."""
    text = tokens_text(requests_per_s=3).replace('roles = ["producer"]', 'roles = ["producer"]\nsubjects = ["x.*"]')
    async with served(tmp_path, text) as (_server, store, connection):
        codes = []
        for _ in range(5):
            try:
                await connection.call(Command.SEND, {}, batch(), timeout=5)  # orders.eu: not x.*
            except PeerError as error:
                codes.append(error.code)
    assert codes == ["forbidden"] * 3 + ["rate_limited"] * 2
    assert store.messages == 0


async def test_a_refused_auth_or_a_reload_without_the_token_gates_the_connection_again(tmp_path: Path) -> None:
    async with served(tmp_path, tokens_text()) as (server, _store, connection):
        await connection.call(Command.SEND, {}, batch(), timeout=5)
        with pytest.raises(PeerError):
            await connection.call(Command.AUTH, {"token": "not-a-known-secret-at-all"}, timeout=5)
        with pytest.raises(PeerError) as refused:  # the first token no longer counts on this connection
            await connection.call(Command.SEND, {}, batch(), timeout=5)
        assert refused.value.code == "unauthorized" and "no token yet" in str(refused.value)
        await connection.call(Command.AUTH, {"token": SHOP}, timeout=5)
        await connection.call(Command.SEND, {}, batch(), timeout=5)
        tokens = server.limits.tokens
        assert tokens is not None
        tokens.path.write_text(tokens_text().replace(SHOP, "a-new-shop-secret-0123456789"))
        assert tokens.reload()
        with pytest.raises(PeerError) as refused:
            await connection.call(Command.SEND, {}, batch(), timeout=5)
        assert refused.value.code == "unauthorized" and "no token yet" in str(refused.value)
