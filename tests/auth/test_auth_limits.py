"""Limits per identity: a token's rates (messages/s, bytes/s), requests in flight per connection,
and the refusals counted by reason.

The rate tests serve SEND on a ``FrameServer`` over in-memory streams with
trio's autojump clock, so "a second later" costs nothing; one test runs a real
realtime server and producer to show a rate-limited send rides it out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from delaymq.cli.metrics import transport_families
from delaymq.client import open_producer
from delaymq.client.routes import RouteTable
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.auth import TokenFile, TokenFileError, parse_tokens
from delaymq.net.connection import Connection
from delaymq.net.limits import ConnectionLimits, Limits
from delaymq.net.ratelimit import RATE_LIMITED, RateLimiter
from delaymq.net.requests import Request, batch_messages
from delaymq.net.server import FrameServer
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.records import Message, encode_batch, new_message_id
from delaymq.realtime.server import open_realtime_server

from ..support.tokens import SERVERS_TOKEN, token, tokens_toml
from .conftest import SERVER

SHOP = "shop-secret-0123456789"


def tokens_text(**rates: int) -> str:
    return tokens_toml(SERVERS_TOKEN, token("shop", SHOP, ["producer"], **rates))


def batch(count: int = 1, *, body: bytes = b"paid") -> bytes:
    return encode_batch(
        [Message(new_message_id(), "orders.eu", body=body, deliver_at=1_700_000_000_000) for _ in range(count)]
    )


class Store:
    """A SEND handler that stores what reaches it (nothing refused before it is counted);
    ``refusing``: it refuses instead, as a server that is not master would."""

    def __init__(self) -> None:
        self.messages = 0
        self.refusing = False

    async def send(self, req: Request) -> dict:
        if self.refusing:
            raise RemoteProtocolError("SEND: not the master of this group", code="not_master")
        self.messages += batch_messages(req.frame)
        return {"stored": batch_messages(req.frame)}


@asynccontextmanager
async def served(
    tmp_path: Path, text: str, *, token: str | None = SHOP, **connections: int
) -> AsyncIterator[tuple[FrameServer, Store, Connection]]:
    """A server checking the tokens of ``text`` and a client connection that presented ``token``."""
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    store = Store()
    limits = Limits(tokens=TokenFile(path), connections=ConnectionLimits(**connections))
    server = FrameServer({Command.SEND: store.send}, limits=limits)
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = Connection("memory", client_end, limits=Limits())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_end)
        nursery.start_soon(connection.read_responses)
        if token is not None:
            await connection.call(Command.AUTH, {"token": token}, timeout=5)
        yield server, store, connection
        nursery.cancel_scope.cancel()


async def send_all(connection: Connection, batches: list[bytes]) -> list[PeerError | None]:
    """Every batch as one SEND at once on the connection (a burst); each one's error, or None."""
    results: list[PeerError | None] = [None] * len(batches)

    async def one(index: int, body: bytes) -> None:
        try:
            await connection.call(Command.SEND, {}, body, timeout=5)
        except PeerError as error:
            results[index] = error

    async with trio.open_nursery() as nursery:
        for index, body in enumerate(batches):
            nursery.start_soon(one, index, body)
    return results


# ----------------------------------------------------------------------------- the tokens file


def test_rates_are_optional_per_token_and_a_bad_one_is_named() -> None:
    table = parse_tokens(tokens_text(messages_per_s=100, bytes_per_s=65536))
    shop = table.identify(SHOP)
    assert shop is not None and shop.rates == {"messages_per_s": 100.0, "bytes_per_s": 65536.0}
    servers = table.identify(SERVER)
    assert servers is not None and servers.rates == {}  # the default: no limit
    for value, words in (("0", "messages_per_s: must be a number of at least 1, not 0"), ('"fast"', "not 'fast'")):
        with pytest.raises(TokenFileError) as bad:
            parse_tokens(
                tokens_text().replace('roles = ["producer"]', f'roles = ["producer"]\nmessages_per_s = {value}')
            )
        assert words in str(bad.value) and "(shop)" in str(bad.value)


def test_a_bucket_allows_one_seconds_worth_then_refills_and_a_refusal_takes_nothing() -> None:
    limiter = RateLimiter()
    rates = {"messages_per_s": 100.0}
    allowed = sum(
        limiter.check("shop", rates, {"messages_per_s": 1}, 5_000, command="SEND") is None for _ in range(300)
    )
    assert allowed == 100
    refusal = limiter.check("shop", rates, {"messages_per_s": 10}, 5_000, command="SEND")
    assert refusal is not None and refusal.retry_after_ms == 100  # 10 messages at 100/s
    assert limiter.check("shop", rates, {"messages_per_s": 10}, 5_099, command="SEND") is not None
    assert limiter.check("shop", rates, {"messages_per_s": 10}, 5_100, command="SEND") is None
    # a batch larger than a second's worth never fits: refused as a limit, not to be retried
    too_big = limiter.check("shop", rates, {"messages_per_s": 101}, 99_000, command="SEND")
    assert too_big is not None and too_big.retry_after_ms is None and too_big.error().code == "limit"


# ----------------------------------------------------------------------------- rates on a server


async def test_a_token_over_its_messages_per_s_is_refused_retryably_and_stores_nothing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with served(tmp_path, tokens_text(messages_per_s=100)) as (server, store, connection):
        results = await send_all(connection, [batch() for _ in range(300)])
        refused = [error for error in results if error is not None]
        assert store.messages == 100 and len(refused) == 200  # a burst of one second's worth
        error = refused[0]
        assert error.code == RATE_LIMITED and error.field == "messages_per_s" and error.limit == "100 messages/s"
        assert "token 'shop' is over its rate limit of 100 messages/s" in str(error)
        assert error.retry_after_ms is not None and 0 < error.retry_after_ms <= 10
        assert RouteTable.is_retryable(error)

        await trio.sleep(1.0)  # a (virtual) second later: another second's worth
        results = await send_all(connection, [batch() for _ in range(150)])
        assert store.messages == 200 and sum(error is not None for error in results) == 50
        assert server.statistics().refused_by_reason == {RATE_LIMITED: 250}

        await trio.sleep(0.5)  # half a second: half a second's worth, in batches of 10
        results = await send_all(connection, [batch(10) for _ in range(8)])
        assert store.messages == 250 and sum(error is not None for error in results) == 3


async def test_a_batch_the_server_refuses_after_the_rate_check_costs_the_token_nothing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with served(tmp_path, tokens_text(messages_per_s=100)) as (server, store, connection):
        store.refusing = True  # say, the group's master moved: the client sends it again elsewhere
        results = await send_all(connection, [batch(50), batch(50)])
        assert [error.code if error else None for error in results] == ["not_master", "not_master"]
        store.refusing = False
        results = await send_all(connection, [batch(50), batch(50)])  # the same instant: a full second's worth
        assert results == [None, None] and store.messages == 100


async def test_a_token_over_its_bytes_per_s_is_refused_naming_the_limit(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    one = batch(body=b"x" * 900)
    rate = 10 * len(one)
    async with served(tmp_path, tokens_text(bytes_per_s=rate)) as (server, store, connection):
        results = await send_all(connection, [batch(body=b"x" * 900) for _ in range(30)])
        refused = [error for error in results if error is not None]
        assert store.messages == 10 and len(refused) == 20
        assert refused[0].code == RATE_LIMITED and refused[0].field == "bytes_per_s"
        assert f"rate limit of {rate} bytes/s" in str(refused[0]) and RouteTable.is_retryable(refused[0])

        await trio.sleep(1.0)
        results = await send_all(connection, [batch(body=b"x" * 900) for _ in range(10)])
        assert store.messages == 20 and all(error is None for error in results)

        # more than a second's worth in one batch: a limit of the request itself, never retried
        (too_big,) = await send_all(connection, [batch(body=b"x" * (rate + 1))])
        assert too_big is not None and too_big.code == "limit" and too_big.field == "bytes_per_s"
        assert "more than token 'shop' may send at once" in str(too_big) and not RouteTable.is_retryable(too_big)
        assert store.messages == 20


async def test_refusals_are_counted_by_reason_and_exposed_as_a_metric(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with served(tmp_path, tokens_text(messages_per_s=1), token=None) as (server, store, connection):
        (unauthorized,) = await send_all(connection, [batch()])  # no AUTH on this connection
        assert unauthorized is not None and unauthorized.code == "unauthorized"
        await connection.call(Command.AUTH, {"token": SHOP}, timeout=5)
        results = [(await send_all(connection, [body]))[0] for body in (batch(), batch(), batch(), batch(2))]
        assert [error.code if error else None for error in results] == [None, RATE_LIMITED, RATE_LIMITED, "limit"]
        stats = server.statistics()
    assert stats.refused_by_reason == {"unauthorized": 1, RATE_LIMITED: 2, "limit": 1}
    assert stats.errors_answered == 4
    (family,) = [f for f in transport_families(stats) if f.name == "delaymq_requests_refused"]
    samples = {sample.labels["reason"]: sample.value for sample in family.samples if sample.name.endswith("_total")}
    assert samples == {"limit": 1, RATE_LIMITED: 2, "unauthorized": 1}


# ----------------------------------------------------------------------------- in flight per connection


async def test_a_connection_at_its_in_flight_cap_waits_and_nothing_is_refused(tmp_path: Path) -> None:
    """Back-pressure: past ``max_in_flight`` the server reads no more of the connection until an answer."""
    release = trio.Event()
    started = 0

    async def slow_ping(req: Request) -> dict:
        nonlocal started
        started += 1
        await release.wait()
        return {}

    server = FrameServer({Command.PING: slow_ping}, limits=Limits(connections=ConnectionLimits(max_in_flight=2)))
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = Connection("memory", client_end, limits=Limits())
    answered = 0

    async def ping() -> None:
        nonlocal answered
        await connection.call(Command.PING, {}, timeout=10)
        answered += 1

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_stream, server_end)
            nursery.start_soon(connection.read_responses)
            async with trio.open_nursery() as pings:
                for _ in range(5):
                    pings.start_soon(ping)
                await trio.testing.wait_all_tasks_blocked()
                assert started == 2 and answered == 0  # two handled, three unread in the stream
                assert server.statistics().in_flight_full == 1
                release.set()
            assert started == 5 and answered == 5  # every one answered once slots came free
            assert server.statistics().refused_by_reason == {}
            nursery.cancel_scope.cancel()


def test_the_in_flight_cap_has_a_default_and_a_server_option() -> None:
    import argparse

    from delaymq.cli.connection_options import add_connection_options, connection_limits

    assert ConnectionLimits().max_in_flight == 1024
    parser = argparse.ArgumentParser()
    add_connection_options(parser)
    assert connection_limits(parser.parse_args([])).max_in_flight == 1024
    assert connection_limits(parser.parse_args(["--max-in-flight", "8"])).max_in_flight == 8
    with pytest.raises(ValueError, match="max_in_flight must be a whole number of at least 1, not 0"):
        ConnectionLimits(max_in_flight=0)


# ----------------------------------------------------------------------------- a real producer


async def test_a_producer_rides_out_its_tokens_rate_on_a_real_realtime_server(tmp_path: Path) -> None:
    """Each refused SEND is retried (after ``retry_after_ms``) until stored: all arrive, none twice."""
    path = tmp_path / "tokens.toml"
    path.write_text(tokens_text(messages_per_s=200))
    clock = SystemClock()
    limits = Limits(tokens=TokenFile(path), token=SERVER)
    async with open_metaserver(data_dir=tmp_path / "meta", clock=clock, limits=limits) as meta:
        assert meta.address is not None
        async with open_realtime_server(
            data_dir=tmp_path / "rt", clock=clock, meta_address=meta.address, limits=limits
        ) as realtime:
            with trio.fail_after(20):
                while not (realtime.registration and realtime.registration.registered):
                    await trio.sleep(0.01)
                async with open_producer(meta.address, limits=Limits(token=SHOP), send_timeout=15.0) as producer:
                    async with trio.open_nursery() as nursery:
                        for start in range(0, 300, 10):  # 30 batches of 10 at once: 1.5 s's worth
                            messages = [producer.message(f"orders.{start + i}", b"paid") for i in range(10)]
                            nursery.start_soon(producer.send_batch, messages)
            assert realtime.statistics().messages_stored == 300
            assert realtime.frame_server.statistics().refused_by_reason.get(RATE_LIMITED, 0) > 0
