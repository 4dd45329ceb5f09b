"""The certificates of the TLS tests, made on the fly with ``trustme`` (once per module)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from delaymq.protocol.tls import TlsSettings


@dataclass(frozen=True)
class Pki:
    """The files of one CA, a server certificate for 127.0.0.1, a client certificate, and a stranger CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path

    def server(self, *, require_client_cert: bool = False) -> TlsSettings:
        return TlsSettings(
            cert=self.server_cert, key=self.server_key, ca=self.ca, require_client_cert=require_client_cert
        )

    def client(self, *, with_cert: bool = True) -> TlsSettings:
        if not with_cert:
            return TlsSettings(ca=self.ca)
        return TlsSettings(cert=self.client_cert, key=self.client_key, ca=self.ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@delaymq.test")
    files = {
        "ca": ca.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
        "other_ca": other.cert_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(folder / f"{name}.pem"))
    return Pki(**{name: folder / f"{name}.pem" for name in files})
