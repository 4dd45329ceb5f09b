"""Given ``--tls-ca``, that CA alone is trusted: a certificate from a CA the system's store
holds (``SSL_CERT_FILE`` stands in for the store here) is refused, by a client and by a
server requiring client certificates alike."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trustme

from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import PeerUnavailable
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.net.tls import TlsSettings
from delaymq.protocol.commands import Command

WAIT = 20.0


@dataclass(frozen=True)
class TwoCas:
    """The cluster's CA (``ours``) and one the system's store trusts (``system``), each with a certificate
    for 127.0.0.1 (server and client purposes both)."""

    ours: Path
    ours_cert: Path
    ours_key: Path
    system: Path
    system_cert: Path
    system_key: Path


@pytest.fixture
def two_cas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TwoCas:
    files: dict[str, Path] = {}
    for name in ("ours", "system"):
        ca = trustme.CA()
        issued = ca.issue_cert("127.0.0.1")
        for suffix, blob in (("", ca.cert_pem), ("_cert", issued.cert_chain_pems[0]), ("_key", issued.private_key_pem)):
            path = tmp_path / f"{name}{suffix}.pem"
            blob.write_to_path(str(path))
            files[name + suffix] = path
    # OpenSSL's default store is this file while the test runs: what the system trusts.
    monkeypatch.setenv("SSL_CERT_FILE", str(files["system"]))
    return TwoCas(**files)


async def _ping(address: str, tls: TlsSettings) -> None:
    async with open_peers(limits=Limits(tls=tls)) as peers:
        await peers.call(address, Command.PING, {}, timeout=WAIT)


async def test_a_client_given_a_ca_refuses_a_server_certified_by_a_ca_of_the_systems_store(
    tmp_path: Path, two_cas: TwoCas
) -> None:
    impostor = Limits(tls=TlsSettings(cert=two_cas.system_cert, key=two_cas.system_key))
    async with open_metaserver(data_dir=tmp_path / "meta", clock=SystemClock(), limits=impostor) as meta:
        assert meta.address is not None
        with trio.fail_after(WAIT):
            await _ping(meta.address, TlsSettings())  # no --tls-ca: the system's store trusts it
            with pytest.raises(PeerUnavailable, match="certificate verify failed"):
                await _ping(meta.address, TlsSettings(ca=two_cas.ours))


async def test_a_server_given_a_ca_refuses_a_client_certificate_from_a_ca_of_the_systems_store(
    tmp_path: Path, two_cas: TwoCas, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="delaymq.net.server")
    server = TlsSettings(cert=two_cas.ours_cert, key=two_cas.ours_key, ca=two_cas.ours, require_client_cert=True)
    async with open_metaserver(data_dir=tmp_path / "meta", clock=SystemClock(), limits=Limits(tls=server)) as meta:
        assert meta.address is not None
        with trio.fail_after(WAIT):
            await _ping(meta.address, TlsSettings(cert=two_cas.ours_cert, key=two_cas.ours_key, ca=two_cas.ours))
            stranger = TlsSettings(cert=two_cas.system_cert, key=two_cas.system_key, ca=two_cas.ours)
            with pytest.raises(PeerUnavailable):
                await _ping(meta.address, stranger)
    refusals = [record.getMessage() for record in caplog.records if "TLS handshake failed" in record.getMessage()]
    assert len(refusals) == 1 and "certificate verify failed" in refusals[0]
