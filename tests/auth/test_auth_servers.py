"""Tokens on a running cluster: refused requests store nothing; the servers' own token registers and delivers.

The servers run in-process on loopback with the real clock, plaintext and TLS.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from delaymq.client import open_consumer, open_producer
from delaymq.net.auth import FORBIDDEN, UNAUTHORIZED, TokenFile
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.net.tls import TlsSettings
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import Message, encode_batch, new_message_id

from ..conftest import LocalServers, Pki, open_local_servers
from .conftest import CONSUMER, ORDERS, PRODUCER, SERVER

WAIT = 20.0


@dataclass
class Cluster(LocalServers):
    tls: TlsSettings | None = None  # what a client trusts

    def client(self, token: str | None) -> Limits:
        return Limits(token=token, tls=self.tls)


@asynccontextmanager
async def open_cluster(tmp_path: Path, tokens_file: Path, tls: TlsSettings | None = None) -> AsyncIterator[Cluster]:
    """The servers with the tokens file and their own token (they register with it)."""
    limits = Limits(tokens=TokenFile(tokens_file), token=SERVER, tls=tls)
    async with open_local_servers(tmp_path, limits, wait=WAIT) as servers:
        client_tls = None if tls is None else TlsSettings(ca=tls.ca)
        yield Cluster(servers.meta, servers.realtime, servers.scheduler, client_tls)


@pytest.fixture(params=["plaintext", "tls"])
def tls(request: pytest.FixtureRequest, pki: Pki) -> TlsSettings | None:
    return None if request.param == "plaintext" else pki.server()


REFUSALS = [
    pytest.param(None, "payments", UNAUTHORIZED, "no token", id="no-token"),
    pytest.param("wrong-token", "payments", UNAUTHORIZED, "unknown token", id="wrong-token"),
    pytest.param(CONSUMER, "payments", FORBIDDEN, "role producer or server needed", id="consumer-only"),
    pytest.param(
        ORDERS, "payments", FORBIDDEN, "subject 'payments' not allowed for 'orders-service'", id="orders-only"
    ),
]


@pytest.mark.parametrize(("token", "subject", "code", "words"), REFUSALS)
async def test_a_refused_producer_is_told_why_and_nothing_is_stored(
    tmp_path: Path, tokens_file: Path, tls: TlsSettings | None, token: str | None, subject: str, code: str, words: str
) -> None:
    async with open_cluster(tmp_path, tokens_file, tls) as cluster:
        async with open_producer(cluster.address, limits=cluster.client(token), timeout=5.0) as producer:
            for delay in (60, None):  # SCHEDULE to the scheduler, SEND to the realtime server
                with pytest.raises(Exception) as refused:
                    with trio.fail_after(WAIT):  # refused at once, never retried for minutes
                        await producer.send_batch([producer.message(subject, b"paid", delay=delay)])
                assert words in str(refused.value), refused.value
        # the servers' own view: nothing stored
        assert cluster.scheduler.statistics().scheduled == 0
        assert cluster.scheduler.statistics().message_log_end == 0
        assert cluster.realtime.statistics().messages_stored == 0
        # the same token on a raw connection: the error code a program reads
        batch = encode_batch([Message(new_message_id(), subject, body=b"paid", deliver_at=2**41)])
        async with open_peers(limits=cluster.client(token)) as peers:
            with pytest.raises(PeerError) as error:
                await peers.call(cluster.scheduler.address or "", Command.SCHEDULE, {}, batch, timeout=WAIT)
            assert error.value.code == code
            assert words in str(error.value)
        assert cluster.scheduler.statistics().message_log_end == 0


async def test_allowed_tokens_send_and_consume_through_the_servers_own_token(
    tmp_path: Path, tokens_file: Path, tls: TlsSettings | None
) -> None:
    """The scheduler delivers to the realtime server, and both registered, with the server token."""
    async with open_cluster(tmp_path, tokens_file, tls) as cluster:
        async with open_consumer(
            cluster.address, "orders.eu", group="billing", start="earliest", limits=cluster.client(ORDERS)
        ) as consumer:
            async with open_producer(cluster.address, limits=cluster.client(ORDERS)) as producer:
                [delayed] = await producer.send_batch([producer.message("orders.eu", b"later", delay=0.2)])
            async with open_producer(cluster.address, limits=cluster.client(PRODUCER)) as producer:
                [now] = await producer.send_batch([producer.message("orders.eu", b"now")])
            received = []
            with trio.fail_after(WAIT):
                while len(received) < 2:
                    message = await consumer.receive()
                    await consumer.ack(message)
                    received.append(message.id)
        assert sorted(received) == sorted([str(delayed), str(now)])
        assert cluster.scheduler.statistics().scheduled == 1


async def test_a_consumer_token_limited_to_orders_cannot_pull_payments(tmp_path: Path, tokens_file: Path) -> None:
    async with open_cluster(tmp_path, tokens_file) as cluster:
        with pytest.raises(Exception) as refused:
            with trio.fail_after(WAIT):
                async with open_consumer(
                    cluster.address, "payments", group="billing", limits=cluster.client(ORDERS)
                ) as consumer:
                    await consumer.receive()
        assert "subject 'payments'" in str(refused.value) and "not allowed for 'orders-service'" in str(refused.value)


async def test_a_producer_cannot_carry_a_schedulers_fence_and_delayed_delivery_goes_on(
    tmp_path: Path, tokens_file: Path
) -> None:
    """A SEND with the scheduler group's fence at the highest epoch, from a producer: refused, nothing fenced."""
    async with open_cluster(tmp_path, tokens_file) as cluster:
        group = cluster.scheduler.group
        fence = {"fence": {"group": group, "epoch": 2**63 - 1}}
        batch = encode_batch([Message(new_message_id(), "orders.eu", body=b"x")])
        async with open_peers(limits=cluster.client(PRODUCER)) as peers:
            with pytest.raises(PeerError) as refused:
                await peers.call(cluster.realtime.address or "", Command.SEND, fence, batch, timeout=WAIT)
        assert refused.value.code == FORBIDDEN and refused.value.field == "servers"
        assert f"may not act as server scheduler:{group}" in str(refused.value)
        assert cluster.realtime.statistics().messages_stored == 0
        async with open_consumer(
            cluster.address, "orders.eu", group="billing", start="earliest", limits=cluster.client(ORDERS)
        ) as consumer:
            async with open_producer(cluster.address, limits=cluster.client(ORDERS)) as producer:
                [sent] = await producer.send_batch([producer.message("orders.eu", b"later", delay=0.2)])
            with trio.fail_after(WAIT):
                message = await consumer.receive()  # the scheduler's own fenced SEND still gets through
        assert message.id == sent


async def test_a_consumer_token_cannot_pull_ack_or_nack_as_another_teams_group(
    tmp_path: Path, tokens_file: Path
) -> None:
    """orders-service may consume as billing*; as shipping, or shipping's dead letters, it is refused,
    and shipping's consumers still get every message."""
    async with open_cluster(tmp_path, tokens_file) as cluster:
        async with open_producer(cluster.address, limits=cluster.client(ORDERS)) as producer:
            [sent] = await producer.send_batch([producer.message("orders.eu", b"for shipping")])
        address = cluster.realtime.address or ""
        asks = [
            (Command.PULL, {"group": "shipping", "consumer": "intruder", "subject": "orders.eu", "max": 10}),
            (Command.ACK, {"group": "shipping", "consumer": "intruder", "subject": "orders.eu", "start": 0, "end": 1}),
            (Command.NACK, {"group": "shipping", "consumer": "intruder", "subject": "orders.eu", "start": 0, "end": 1}),
            (Command.PULL, {"group": "billing", "consumer": "c", "subject": "%dead%shipping%orders.eu", "max": 10}),
        ]
        async with open_peers(limits=cluster.client(ORDERS)) as peers:
            for command, metadata in asks:
                with pytest.raises(PeerError) as refused:
                    await peers.call(address, command, metadata, timeout=WAIT)
                assert refused.value.code == FORBIDDEN and refused.value.field == "group", refused.value
                assert "'shipping'" in str(refused.value) and "orders-service" in str(refused.value)
        async with open_consumer(
            cluster.address, "orders.eu", group="shipping", start="earliest", limits=cluster.client(CONSUMER)
        ) as consumer:
            with trio.fail_after(WAIT):
                message = await consumer.receive()
        assert message.id == sent and message.attempts == 0
