"""Connection floods against a real ``delaymq realtime`` process with a low open-file limit.

Without the connection caps, 1,224 idle connections exhausted a 1,024 file limit and locked
every real client out (``accept returned EMFILE``, 176 tracebacks); 4,000 idle
connections were held for ever; 8 connections each sending 60 MiB of a 64 MiB
frame took the server from 40 MB to 595 MB. Here the same floods run while a
real client keeps sending and receiving; each test records what a user would
look at: connections held and refused, how fast a refusal came, the server's
peak memory, the client's successes.
"""

from __future__ import annotations

import re
import resource
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import PeerUnavailable
from delaymq.net.peers import Peers, open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.frames import FRAME_HEADER_SIZE, Frame, FrameDecoder, encode_frame, request
from delaymq.protocol.records import Message, decode_batch, encode_batch

pytestmark = pytest.mark.faults

MiB = 1024 * 1024
FLOOD = 1_224
FILE_LIMIT = 1_024
IDLE_TIMEOUT_S = 3.0
FRAME_TIMEOUT_S = 5.0


@dataclass
class ServerProcess:
    process: trio.Process
    address: str = ""
    log: list[str] = field(default_factory=list)

    def status_mb(self, name: str) -> float:
        """A /proc status figure (VmRSS, VmHWM: the peak) in MiB."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) / 1024
        raise AssertionError(f"no {name} for the server")

    def log_count(self, text: str) -> int:
        return sum(text in line for line in self.log)


@asynccontextmanager
async def realtime_process(data: Path, *options: str) -> AsyncIterator[tuple[ServerProcess, RealClient]]:
    """``delaymq realtime`` in a child process whose open-file limit is ``FILE_LIMIT``, and a real client of it."""

    def lower_file_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, hard))

    # A realtime server obeys its metaserver (master or slave), so one runs here; a group of one member.
    async with open_metaserver(data_dir=data.parent / "meta", clock=SystemClock()) as meta:
        command = [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "info", "realtime", "--data", str(data)]
        command += ["--listen", "127.0.0.1:0", "--meta", meta.address, "--min-insync", "0", *options]
        async with _realtime_child(command, lower_file_limit) as started:
            yield started


@asynccontextmanager
async def _realtime_child(
    command: list[str], lower_file_limit: Callable[[], None]
) -> AsyncIterator[tuple[ServerProcess, RealClient]]:
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, preexec_fn=lower_file_limit)
    server = ServerProcess(process)
    started = trio.Event()

    async def read_log() -> None:
        assert process.stderr is not None
        pending = b""
        while chunk := await process.stderr.receive_some(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                server.log.append(text)
                if match := re.search(r"listening on (\S+)", text):
                    server.address = match[1]
                    started.set()
        started.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_log)
        try:
            with trio.fail_after(30):
                await started.wait()
            assert server.address, "the server did not start:\n" + "\n".join(server.log)
            yield server, RealClient(server.address)
        finally:
            process.kill()
            await process.wait()


async def connect(address: str, *, source: str) -> trio.SocketStream:
    host, port = address.rsplit(":", 1)
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect((host, int(port)))
    return trio.SocketStream(sock)


async def fate(stream: trio.SocketStream) -> tuple[str, str]:
    """Whether the server holds this connection (it answers a request) or refused it, and why."""
    try:
        await stream.send_all(encode_frame(request(Command.PING, 1)))
    except trio.BrokenResourceError:
        pass  # refused and reset; its refusal is still there to read
    decoder = FrameDecoder()
    try:
        while data := await stream.receive_some(65536):
            decoder.feed(data)
            for frame in decoder:
                if frame.request_id == 1:
                    return "held", ""
                return "refused", frame.metadata["error"]["field"]
    except trio.BrokenResourceError:
        pass
    finally:
        await trio.aclose_forcefully(stream)
    return "closed", ""


class RealClient:
    """A producer and consumer of one subject: each round sends a message and pulls it back."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.successes = 0
        self.sent = 0

    async def round(self, peers: Peers) -> None:
        self.sent += 1
        message = Message(f"real-{self.sent:06d}", "orders", body=b"hello")
        answer = await peers.call(self.address, Command.SEND, {}, encode_batch([message]), timeout=10)
        assert answer.metadata["results"] == ["stored"]
        pulled = await peers.call(
            self.address,
            Command.PULL,
            {"group": "g", "consumer": "c", "subject": "orders", "max": 10, "timeout_ms": 5000, "from": "earliest"},
            timeout=10,
        )
        assert [m.id for m in decode_batch(pulled.body)] == [message.id]
        start = pulled.metadata["pull_start"]
        ack = {"group": "g", "consumer": "c", "subject": "orders", "start": start, "end": start + 1}
        await peers.call(self.address, Command.ACK, ack, timeout=10)
        self.successes += 1


async def test_idle_flood_from_one_address_leaves_new_clients_served(tmp_path: Path, fault_report: Any) -> None:
    """A flood of 1,224 idle connections against the limit of 1,024, with every default."""
    async with realtime_process(tmp_path / "realtime") as (server, client):
        baseline_mb = server.status_mb("VmRSS")
        flood: list[trio.SocketStream] = []
        with trio.fail_after(120):
            async with open_peers() as established:
                await client.round(established)
                async with trio.open_nursery() as nursery:

                    async def attack() -> None:
                        for _ in range(FLOOD):
                            flood.append(await connect(server.address, source="127.0.0.2"))

                    nursery.start_soon(attack)
                    rounds = 0
                    while rounds < 20 or len(flood) < FLOOD:  # during the flood and after it
                        rounds += 1
                        await client.round(established)
                        async with open_peers() as newcomer:  # a client that connects now
                            await client.round(newcomer)
                fates = [await fate(stream) for stream in flood]
        held = sum(kind == "held" for kind, _ in fates)
        refused = [why for kind, why in fates if kind == "refused"]
        assert held + len(refused) == FLOOD
        assert 0 < held < FILE_LIMIT // 2
        assert set(refused) == {"connections_per_address"}
        assert client.successes == client.sent
        assert server.log_count("Traceback") == 0
        assert server.log_count("refusing connections") <= 2  # a line for the episode, not one per connection
        fault_report.record(
            flood=FLOOD,
            file_limit=FILE_LIMIT,
            held=held,
            refused=len(refused),
            client_rounds=client.sent,
            client_successes=client.successes,
            tracebacks=server.log_count("Traceback"),
            refusal_log_lines=server.log_count("refusing connections"),
            rss_baseline_mb=round(baseline_mb, 1),
            rss_peak_mb=round(server.status_mb("VmHWM"), 1),
        )


async def test_idle_flood_from_many_addresses_is_refused_promptly_then_closed_idle(
    tmp_path: Path, fault_report: Any
) -> None:
    """Past the file limit every newcomer gets a prompt ``unavailable``; idle connections go after the idle timeout."""
    async with realtime_process(tmp_path / "realtime", "--idle-timeout", f"{IDLE_TIMEOUT_S:g}s") as (server, client):
        flood: list[trio.SocketStream] = []
        refusal_ms: list[float] = []
        with trio.fail_after(120):
            async with open_peers() as established:
                await client.round(established)
                flood_started = trio.current_time()
                for number in range(FLOOD):
                    flood.append(await connect(server.address, source=f"127.0.0.{2 + number % 8}"))
                await client.round(established)  # a client connected before the flood: served
                # A newcomer is refused at once, with a reason, until the idle ones are closed.
                while True:
                    started = time.monotonic()
                    async with open_peers() as newcomer:
                        try:
                            await client.round(newcomer)
                            break
                        except PeerUnavailable as error:
                            refusal_ms.append((time.monotonic() - started) * 1000)
                            assert "files open of its limit of 1024" in str(error), error
                    await trio.sleep(0.1)  # the newcomer's retry interval, as a producer's backoff
                recovered_after = trio.current_time() - flood_started
                await client.round(established)
            # Each flood connection ends: with a refusal, or (held) closed when idle, without a word.
            endings = [await answers(stream) for stream in flood]
        refused = [frames[0].metadata["error"]["field"] for frames in endings if frames]
        closed_idle = sum(not frames for frames in endings)
        assert refusal_ms, "no newcomer was refused: the flood did not reach the file limit"
        assert max(refusal_ms) < 1000
        assert set(refused) == {"file_descriptors"}
        assert closed_idle + len(refused) == FLOOD  # none still held: idle ones were closed
        assert IDLE_TIMEOUT_S <= recovered_after < IDLE_TIMEOUT_S + 30
        assert client.successes == client.sent - len(refusal_ms)
        assert server.log_count("Traceback") == 0
        fault_report.record(
            flood=FLOOD,
            file_limit=FILE_LIMIT,
            held_then_closed_idle=closed_idle,
            refused=len(refused),
            newcomers_refused=len(refusal_ms),
            max_refusal_ms=round(max(refusal_ms), 1),
            recovered_after_s=round(recovered_after, 1),
            client_successes=client.successes,
            tracebacks=server.log_count("Traceback"),
            refusal_log_lines=server.log_count("refusing connections"),
        )


async def test_half_sent_frames_cannot_take_the_server_past_its_buffer_budget(
    tmp_path: Path, fault_report: Any
) -> None:
    """8 connections each send 60 MiB of a 64 MiB frame: the budget (128 MiB) holds, the rest are closed."""
    async with realtime_process(tmp_path / "realtime", "--frame-timeout", f"{FRAME_TIMEOUT_S:g}s") as (server, client):
        baseline_mb = server.status_mb("VmRSS")
        declared = 64 * MiB - FRAME_HEADER_SIZE
        header = struct.pack(">2sBBHIII", b"DQ", 1, 0, Command.SEND, 7, 0, declared)
        chunk = memoryview(b"\0" * MiB)
        reasons: list[str] = []
        sent_mib: list[int] = []

        async def attacker() -> None:
            stream = await connect(server.address, source="127.0.0.2")
            sent = 0
            try:
                await stream.send_all(header)
                while sent < 60:
                    await stream.send_all(chunk)
                    sent += 1
            except trio.BrokenResourceError:
                pass
            sent_mib.append(sent)
            frames = await answers(stream)
            reasons.append(frames[0].metadata["error"]["field"] if frames else "closed")

        with trio.fail_after(120):
            async with open_peers() as peers:
                await client.round(peers)
                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(attacker)
                    while len(reasons) < 8:  # bounded: attackers end when closed or timed out
                        await client.round(peers)
                await client.round(peers)
        peak_mb = server.status_mb("VmHWM")
        assert sorted(set(reasons)) == ["buffered_bytes", "frame_timeout"], reasons
        assert client.successes == client.sent
        assert peak_mb - baseline_mb < 128 + 64, f"peak {peak_mb:.0f} MiB from {baseline_mb:.0f} MiB"
        fault_report.record(
            attackers=8,
            refused_over_budget=reasons.count("buffered_bytes"),
            closed_slow=reasons.count("frame_timeout"),
            mib_sent=sum(sent_mib),
            rss_baseline_mb=round(baseline_mb, 1),
            rss_peak_mb=round(peak_mb, 1),
            client_successes=client.successes,
        )


async def answers(stream: trio.SocketStream) -> list[Frame]:
    """The frames the server sends before it closes the stream."""
    decoder = FrameDecoder()
    frames: list[Frame] = []
    try:
        while data := await stream.receive_some(65536):
            decoder.feed(data)
            frames.extend(decoder)
    except trio.BrokenResourceError:
        pass
    finally:
        await trio.aclose_forcefully(stream)
    return frames
