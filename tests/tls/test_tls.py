"""TLS on every listener and every connection, with certificates made on the fly (``trustme``).

The servers run in-process on loopback with the real clock (a TLS handshake is
real socket traffic, which an autojump clock would jump over).
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import trio

from delaymq.client import open_consumer, open_producer
from delaymq.client.routes import CallFailed
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.net.tls import TLS_REQUIRED, TlsConfigError, TlsSettings
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError

from ..conftest import LocalServers, Pki, open_local_servers

WAIT = 20.0  # seconds a test may wait for what it expects


def open_cluster(tmp_path: Path, tls: TlsSettings) -> AbstractAsyncContextManager[LocalServers]:
    """A metaserver, a realtime server and a scheduler on loopback, every listener and connection with
    ``tls``; both servers registered: they reached the metaserver over TLS."""
    return open_local_servers(tmp_path, Limits(tls=tls), wait=WAIT)


async def test_a_delayed_message_goes_producer_scheduler_realtime_consumer_over_mutual_tls(
    tmp_path: Path, pki: Pki
) -> None:
    """Every hop (registration, SCHEDULE, delivery to realtime, PULL) under TLS with client certificates required."""
    async with open_cluster(tmp_path, pki.server(require_client_cert=True)) as cluster:
        client = Limits(tls=pki.client())
        meta = cluster.meta.address
        assert meta is not None
        async with open_consumer(meta, "orders", group="billing", start="earliest", limits=client) as consumer:
            async with open_producer(meta, limits=client) as producer:
                [sent] = await producer.send_batch([producer.message("orders", b"paid", delay=0.3)])
            with trio.fail_after(WAIT):
                message = await consumer.receive()
            await consumer.ack(message)
        assert (message.id, message.body) == (str(sent), b"paid")
        assert message.received_at >= message.deliver_at
        assert cluster.scheduler.statistics().scheduled == 1


async def test_a_client_that_does_not_trust_the_servers_ca_refuses_them_and_nothing_is_stored(
    tmp_path: Path, pki: Pki
) -> None:
    async with open_cluster(tmp_path, pki.server()) as cluster:
        meta = cluster.meta.address
        assert meta is not None
        stranger = Limits(tls=TlsSettings(ca=pki.other_ca))
        async with open_producer(meta, limits=stranger, send_timeout=0.5, timeout=2.0) as producer:
            with pytest.raises(CallFailed) as failed:
                await producer.send_batch([producer.message("orders", b"paid", delay=60)])
        assert "certificate verify failed" in str(failed.value)
        assert cluster.scheduler.statistics().scheduled == 0
        assert cluster.scheduler.statistics().message_log_end == 0


async def test_a_server_requiring_client_certificates_refuses_a_client_without_one(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="delaymq.net.server")
    async with open_cluster(tmp_path, pki.server(require_client_cert=True)) as cluster:
        meta = cluster.meta.address
        assert meta is not None
        anonymous = Limits(tls=pki.client(with_cert=False))
        async with open_producer(meta, limits=anonymous, send_timeout=0.5, timeout=2.0) as producer:
            with pytest.raises(CallFailed) as failed:
                await producer.send_batch([producer.message("orders", b"paid", delay=60)])
        assert "certificate" in str(failed.value)  # the server's alert: certificate required
        assert cluster.scheduler.statistics().message_log_end == 0
        refusals = [r.getMessage() for r in caplog.records if "TLS handshake failed" in r.getMessage()]
        assert refusals and all("did not return a certificate" in line for line in refusals)
        assert not any(record.exc_info for record in caplog.records)


async def test_a_plaintext_client_is_told_the_listener_takes_tls_only_and_the_server_keeps_serving(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.net.server")
    clock = SystemClock()
    async with open_metaserver(data_dir=tmp_path / "meta", clock=clock, limits=Limits(tls=pki.server())) as meta:
        assert meta.address is not None
        async with open_peers() as plaintext:
            with pytest.raises(PeerError, match="takes TLS connections only") as refused:
                await plaintext.call(meta.address, Command.PING, {}, timeout=WAIT)
        assert refused.value.code == TLS_REQUIRED  # not retryable: no retry changes the client's configuration
        lines = [r for r in caplog.records if "plaintext connection" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING and not lines[0].exc_info
        async with open_peers(limits=Limits(tls=pki.client())) as secured:
            answer = await secured.call(meta.address, Command.PING, {}, timeout=WAIT)
        assert "now_ms" in answer.metadata


async def test_a_plaintext_producer_is_refused_at_once_with_the_reason_and_nothing_is_stored(
    tmp_path: Path, pki: Pki
) -> None:
    async with open_cluster(tmp_path, pki.server()) as cluster:
        meta = cluster.meta.address
        assert meta is not None
        async with open_producer(meta, send_timeout=60) as producer:
            with trio.fail_after(WAIT), pytest.raises(PeerError, match="takes TLS connections only"):
                await producer.send_batch([producer.message("orders", b"paid", delay=60)])
        assert cluster.scheduler.statistics().message_log_end == 0


def test_settings_name_the_option_whose_file_is_missing_or_wrong(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsConfigError, match=r"--tls-ca .*nope\.pem: cannot read it") as error:
        TlsSettings(ca=missing)
    assert error.value.option == "--tls-ca"
    with pytest.raises(TlsConfigError, match="--tls-cert .*nope.pem"):
        TlsSettings(cert=missing, key=pki.server_key)
    with pytest.raises(TlsConfigError, match="--tls-key .*nope.pem"):
        TlsSettings(cert=pki.server_cert, key=missing)
    with pytest.raises(TlsConfigError, match="not a certificate and its private key"):
        TlsSettings(cert=pki.server_cert, key=pki.client_key)  # a key that is not this certificate's
    with pytest.raises(TlsConfigError, match="not a CA certificate"):
        TlsSettings(ca=pki.server_key)
    with pytest.raises(TlsConfigError, match="--tls-key needs --tls-cert"):
        TlsSettings(key=pki.server_key)
    with pytest.raises(TlsConfigError, match="--tls-require-client-cert needs --tls-ca"):
        TlsSettings(cert=pki.server_cert, key=pki.server_key, require_client_cert=True)
    assert not TlsSettings(ca=pki.ca).listens and pki.server().listens
