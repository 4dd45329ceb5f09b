"""The blocking clients: a thin layer that runs the trio clients on a loop thread.

A metaserver and a realtime server run in the test's trio loop on loopback;
the blocking clients run in worker threads (``trio.to_thread``) with their own
loop thread each, as in a user's program. Real sockets and the real clock, so
every wait is bounded by ``fail_after`` and ends on an observable condition.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.client import (
    BlockingConsumer,
    BlockingProducer,
    CallTimedOut,
    LocalProtocolError,
    NoRouteError,
    PeerError,
    Producer,
    open_consumer,
    open_producer,
)
from delaymq.client.blocking import BlockingPeers
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import RequestTimeout
from delaymq.net.peers import Peers, open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.realtime.server import RealtimeServer, open_realtime_server

from ..support.polling import wait_until

WAIT = 20.0  # seconds any one test may wait


@dataclass
class Cluster:
    meta: str
    realtime: RealtimeServer


@asynccontextmanager
async def open_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    clock = SystemClock()
    async with open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta:
        assert meta.address is not None
        async with open_realtime_server(
            data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=meta.address, flush="async"
        ) as realtime:
            yield Cluster(meta.address, realtime)


async def register(meta: str, group: str, address: str, *, kind: str = "realtime") -> None:
    async with open_peers() as peers:
        info = {"group": group, "kind": kind, "role": "master", "address": address, "version": "0"}
        await peers.call(meta, Command.REGISTER, info)


def parameters(function: Callable[..., Any], *, without: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    signature = inspect.signature(function)
    return [(p.name, p.kind, p.default) for p in signature.parameters.values() if p.name not in without]


# ---------------------------------------------------------------- one set of options


def test_the_blocking_clients_take_the_trio_clients_options_with_the_same_defaults() -> None:
    assert parameters(BlockingProducer) == parameters(open_producer, without=("peers",))
    assert parameters(BlockingConsumer) == parameters(open_consumer)
    assert parameters(BlockingPeers) == parameters(Peers, without=("nursery",))
    assert parameters(BlockingProducer.send) == parameters(Producer.send)
    assert parameters(BlockingProducer.send_batch) == parameters(Producer.send_batch)
    assert parameters(BlockingPeers.call) == parameters(Peers.call)
    # The default that had drifted: the blocking consumer long-polled in 1 s rounds.
    assert inspect.signature(BlockingConsumer).parameters["poll_timeout"].default == 30.0
    with pytest.raises(TypeError, match="BlockingConsumer: got an unexpected keyword argument 'poll_timout'"):
        BlockingConsumer("127.0.0.1:1", "orders", group="g", poll_timout=5)
    with pytest.raises(TypeError, match="BlockingProducer: got an unexpected keyword argument 'peers'"):
        BlockingProducer("127.0.0.1:1", peers=None)


# ---------------------------------------------------------------- receiving and closing


async def test_a_blocking_receive_is_one_long_poll_and_returns_as_soon_as_a_message_arrives(tmp_path: Path) -> None:
    """Real clock and sockets, so the bound is generous: loopback delivers in a few ms, a poll round takes 1 s.

    What tells a real long poll from rounds of short polls is the number of
    PULLs the server answered while the consumer sat idle: none.
    """
    async with open_cluster(tmp_path) as cluster:
        idle = trio.Event()
        result: dict[str, Any] = {}

        def consume() -> None:
            with BlockingConsumer(cluster.meta, "orders", group="g") as consumer:
                result["idle"] = consumer.receive(timeout=2)  # nothing comes: one poll per lane stays parked
                result["answered_while_idle"] = trio.from_thread.run_sync(cluster.realtime.statistics).pulls
                trio.from_thread.run_sync(idle.set)
                message = consumer.receive(timeout=10)
                result["received_at"] = time.monotonic()
                assert message is not None
                message.ack()
                result["message"] = message

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, consume)
                await idle.wait()
                async with open_producer(cluster.meta) as producer:
                    sent_at = time.monotonic()
                    message_id = await producer.send("orders", b"now")
        assert result["idle"] is None
        assert result["answered_while_idle"] == 0  # 1 s rounds answer a PULL per lane each second
        assert result["message"].id == message_id
        assert result["received_at"] - sent_at < 0.5


async def test_close_ends_a_receive_waiting_in_another_thread_at_once(tmp_path: Path) -> None:
    async with open_cluster(tmp_path) as cluster:
        consumer = BlockingConsumer(cluster.meta, "orders", group="g")
        await trio.to_thread.run_sync(consumer.start)
        # the subject and its retries
        await wait_until(lambda: cluster.realtime.statistics().pulls_waiting == 2, timeout=WAIT)
        waiting = threading.Event()
        result: dict[str, Any] = {}

        def receive() -> None:
            waiting.set()
            result["message"] = consumer.receive(timeout=10)
            result["returned_at"] = time.monotonic()

        def close() -> float:
            waiting.wait()
            # The receive must really wait in the loop (a call in flight there), not start after the close.
            deadline = time.monotonic() + WAIT
            while not consumer._loop._calls:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the receive never reached the loop"
                time.sleep(0.001)
            started = time.monotonic()
            consumer.close()
            return started

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, receive)
                close_started = await trio.to_thread.run_sync(close)
                closed_at = time.monotonic()
        assert result["message"] is None
        assert result["returned_at"] - close_started < 0.5  # not the 10 s timeout, nor a poll round
        assert closed_at - close_started < 0.5  # close does not wait out the long polls either
        assert not [t for t in threading.enumerate() if t.name == "delaymq-consumer"]  # the loop thread ended
        await wait_until(lambda: cluster.realtime.statistics().pulls_waiting == 0, timeout=WAIT)


async def test_acks_go_out_without_flush_and_what_was_acked_before_close_is_not_given_back(tmp_path: Path) -> None:
    async with open_cluster(tmp_path) as cluster:
        async with open_producer(cluster.meta) as producer:
            await producer.send_batch([producer.message("orders", f"m{n}") for n in range(4)])

        def consume() -> list[str]:
            with BlockingConsumer(cluster.meta, "orders", group="g", start="earliest") as consumer:
                first = consumer.receive(timeout=WAIT)
                assert first is not None
                first.ack()  # sent in the background, no flush
                trio.from_thread.run(partial(wait_until, timeout=None), lambda: cluster.realtime.statistics().acks >= 1)
                rest = [consumer.receive(timeout=WAIT) for _ in range(3)]
                for message in rest:
                    assert message is not None
                    consumer.ack(message)  # closed right after: these must be acked, not given back
            return [first.id] + [m.id for m in rest if m is not None]

        with trio.fail_after(WAIT):
            ids = await trio.to_thread.run_sync(consume)
        stats = cluster.realtime.statistics()
        assert len(set(ids)) == 4
        assert stats.acks >= 2 and stats.nacks == 0
        assert stats.redeliveries == 0  # a message held at close is given back: these were acked first


# ---------------------------------------------------------------- errors


async def test_errors_raised_in_the_trio_code_reach_the_caller_unchanged(tmp_path: Path) -> None:
    async with open_cluster(tmp_path) as cluster:

        def scenario(step: str) -> BaseException:
            with BlockingProducer(cluster.meta, send_timeout=0.5) as producer:
                with pytest.raises(Exception) as caught:
                    if step == "local":
                        producer.send("s" * 300, b"x")
                    else:
                        producer.send("orders", b"later", delay=60)
            return caught.value

        with trio.fail_after(WAIT):
            local = await trio.to_thread.run_sync(scenario, "local")
            no_route = await trio.to_thread.run_sync(scenario, "delayed")
            await register(cluster.meta, "sched-down", "127.0.0.1:1", kind="scheduler")  # nothing listens there
            timed_out = await trio.to_thread.run_sync(scenario, "delayed")
        assert type(local) is LocalProtocolError
        assert isinstance(local, LocalProtocolError) and local.field == "subject"
        assert type(no_route) is NoRouteError and "no scheduler group" in str(no_route)
        assert type(timed_out) is CallTimedOut and "(send_timeout is 0.5 s)" in str(timed_out)
        assert "group sched-down at 127.0.0.1:1" in str(timed_out)


async def test_the_blocking_producer_sends_a_refused_request_to_another_group(tmp_path: Path) -> None:
    refused: list[int] = []

    async def send(request: Request) -> None:
        refused.append(len(request.body))
        raise RemoteProtocolError("group is read-only", code="read_only")

    async with open_cluster(tmp_path) as cluster, trio.open_nursery() as nursery:
        address = await nursery.start(FrameServer({Command.SEND: send}).serve)
        await register(cluster.meta, "rt0-readonly", address)

        def produce() -> tuple[list[str], Any]:
            with BlockingProducer(cluster.meta) as producer:
                ids = [producer.send("orders", f"m{n}") for n in range(4)]
                return ids, producer.statistics()

        with trio.fail_after(WAIT):
            ids, stats = await trio.to_thread.run_sync(produce)
        assert len(set(ids)) == 4 and stats.messages == 4
        assert refused and stats.routes.refused == len(refused)  # tried, refused, sent elsewhere
        assert cluster.realtime.statistics().messages_stored == 4
        nursery.cancel_scope.cancel()


async def echo(request: Request) -> tuple[dict[str, Any], bytes]:
    if request.metadata.get("sleep"):
        await trio.sleep(request.metadata["sleep"])
    return {"echo": request.metadata.get("value")}, request.body


async def test_blocking_peers_speak_the_protocol_of_peers() -> None:
    async with trio.open_nursery() as nursery:
        address = await nursery.start(FrameServer({Command.PING: echo}).serve)

        def blocking_client() -> list[Any]:
            with BlockingPeers(request_timeout=5) as peers:
                first = peers.call(address, Command.PING, {"value": 1}, b"abc")
                with pytest.raises(PeerError) as refused:
                    peers.call(address, 999)
                second = peers.call(address, Command.PING, {"value": 2})
                with pytest.raises(RequestTimeout):
                    peers.call(address, Command.PING, {"sleep": 5}, timeout=0.05)
                third = peers.call(address, Command.PING, {"value": 3})
                return [first.metadata, first.body, refused.value.code, second.metadata, third.metadata]

        with trio.fail_after(WAIT):
            result = await trio.to_thread.run_sync(blocking_client)
        assert result == [{"echo": 1}, b"abc", "bad_request", {"echo": 2}, {"echo": 3}]
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- the loop thread


async def test_clients_never_closed_do_not_keep_the_interpreter_from_exiting(tmp_path: Path) -> None:
    async with open_cluster(tmp_path) as cluster:
        program = (
            "from delaymq.client import BlockingConsumer, BlockingProducer\n"
            f"producer = BlockingProducer({cluster.meta!r})\n"
            "producer.send('orders', b'left open')\n"
            f"consumer = BlockingConsumer({cluster.meta!r}, 'orders', group='g', start='earliest')\n"
            "print(consumer.receive(timeout=20).body.decode())\n"
        )
        with trio.fail_after(WAIT):
            done = await trio.run_process(
                [sys.executable, "-P", "-c", program], capture_stdout=True, capture_stderr=True, check=False,
                cwd=tmp_path,
            )  # fmt: skip
        assert (done.returncode, done.stdout) == (0, b"left open\n"), done.stderr.decode()


def test_a_producer_dropped_without_close_ends_its_loop_thread() -> None:
    def loop_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "delaymq-producer")

    before = loop_threads()
    assert BlockingProducer("127.0.0.1:1").send_timeout == 30.0  # made, read and dropped
    deadline = time.monotonic() + WAIT
    while loop_threads() > before:
        assert time.monotonic() < deadline, "the loop thread of a dropped producer still runs"
        time.sleep(0.01)
