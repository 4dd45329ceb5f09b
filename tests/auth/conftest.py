"""The tokens file and certificates of the authentication tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from delaymq.protocol.tls import TlsSettings

SERVER = "server-secret-0123456789"
PRODUCER = "producer-secret-0123456789"
CONSUMER = "consumer-secret-0123456789"
ORDERS = "orders-secret-0123456789"
ADMIN = "admin-secret-0123456789"

TOKENS = f"""
[[token]]
name = "servers"
token = "{SERVER}"
roles = ["server"]

[[token]]
name = "shop"
token = "{PRODUCER}"
roles = ["producer"]

[[token]]
name = "billing"
token = "{CONSUMER}"
roles = ["consumer"]

[[token]]
name = "orders-service"
token = "{ORDERS}"
roles = ["producer", "consumer"]
subjects = ["orders.*"]
"""


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path

    def server(self) -> TlsSettings:
        return TlsSettings(cert=self.server_cert, key=self.server_key, ca=self.ca)

    def client(self) -> TlsSettings:
        return TlsSettings(ca=self.ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    server.private_key_pem.write_to_path(str(folder / "server.key"))
    return Pki(folder / "ca.pem", folder / "server.pem", folder / "server.key")
