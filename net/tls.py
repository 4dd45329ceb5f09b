"""TLS settings of a process's connections: its listener's and the ones it dials.

One frozen ``TlsSettings`` holds the files (``--tls-cert``, ``--tls-key``,
``--tls-ca``) and whether a listener requires client certificates; it reads and
checks them once, when it is made, so a missing or unreadable file is an error
naming its option at start, not a failed handshake later. It travels on
``Limits.tls`` (the options every server and client already passes to its
``FrameServer`` and ``Peers``), and the transport wraps streams in
``trio.SSLStream`` with the contexts built here. ``None`` (the default): plaintext.

- A listener uses TLS when a certificate is given; with ``require_client_cert``
  it refuses a client that presents no certificate signed by ``ca`` (and a
  certificate is checked against ``ca`` only, never the system's CAs).
- Connections a process dials always use TLS when settings are given: they
  verify the server against ``ca`` alone (the system's CAs only when there is
  none: given ``ca``, no CA of the system's store, ``SSL_CERT_FILE`` included, is
  trusted) and its address's host name, and present ``cert`` as the client certificate when given.
  So a server's connections to the metaserver and to other servers authenticate
  with the server's own certificate (it needs the clientAuth purpose too; most
  CAs and ``trustme`` issue both).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

#: The first byte of every TLS connection: a handshake record (the ClientHello).
TLS_HANDSHAKE_RECORD = 0x16
#: The error code a TLS listener answers a plaintext client with (before it closes the connection).
#: Not retryable: another try, or another group of the same cluster, refuses the same way.
TLS_REQUIRED = "tls_required"

#: The option that names each file, in errors.
OPTIONS = {
    "cert": "--tls-cert",
    "key": "--tls-key",
    "ca": "--tls-ca",
    "require_client_cert": "--tls-require-client-cert",
}


class TlsConfigError(ValueError):
    """A TLS file is missing, unreadable or not what its option says; ``option`` names it."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsSettings:
    """The TLS files of one process, checked and loaded once (see the module's docstring)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    require_client_cert: bool = False
    _server: ssl.SSLContext | None = field(init=False, default=None, repr=False, compare=False)
    _client: ssl.SSLContext | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
                _check_readable(Path(value), OPTIONS[name])
        if self.key is not None and self.cert is None:
            raise TlsConfigError("--tls-key needs --tls-cert (the certificate of that key)", option="--tls-key")
        if self.require_client_cert and self.ca is None:
            raise TlsConfigError(
                "--tls-require-client-cert needs --tls-ca (the CA that signs the client certificates)",
                option="--tls-require-client-cert",
            )
        object.__setattr__(self, "_client", self._make_client_context())
        if self.cert is not None:
            object.__setattr__(self, "_server", self._make_server_context())

    @property
    def listens(self) -> bool:
        """Whether a listener with these settings uses TLS (it has a certificate to show)."""
        return self._server is not None

    def server_context(self) -> ssl.SSLContext | None:
        """The context of a listener; None: no certificate, the listener stays plaintext."""
        return self._server

    def client_context(self) -> ssl.SSLContext:
        """The context of the connections a process dials."""
        assert self._client is not None
        return self._client

    def describe(self) -> str:
        """A short line for a server's start-up log."""
        if not self.listens:
            return "TLS for outgoing connections only"
        clients = "client certificates required" if self.require_client_cert else "client certificates optional"
        return f"TLS ({clients})" if self.ca is not None else "TLS (no CA: client certificates not checked)"

    def _make_client_context(self) -> ssl.SSLContext:
        context = _trusting(ssl.Purpose.SERVER_AUTH, self.ca)
        if self.cert is not None:
            _load_cert_chain(context, self.cert, self.key)
        return context

    def _make_server_context(self) -> ssl.SSLContext:
        assert self.cert is not None
        context = _trusting(ssl.Purpose.CLIENT_AUTH, self.ca)
        _load_cert_chain(context, self.cert, self.key)
        if self.ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        else:
            context.verify_mode = ssl.CERT_NONE
        return context


def _check_readable(path: Path, option: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as error:
        raise TlsConfigError(f"{option} {path}: cannot read it: {error.strerror or error}", option=option) from None


def _trusting(purpose: ssl.Purpose, ca: Path | None) -> ssl.SSLContext:
    """A default context for ``purpose`` that trusts ``ca`` only; without ``ca``, the system's CAs.

    ``create_default_context`` loads the system's store only when it is given no CA file."""
    if ca is None:
        return ssl.create_default_context(purpose)
    try:
        return ssl.create_default_context(purpose, cafile=str(ca))
    except (ssl.SSLError, OSError, ValueError) as error:
        raise TlsConfigError(f"--tls-ca {ca}: not a CA certificate in PEM: {error}", option="--tls-ca") from None


def _load_cert_chain(context: ssl.SSLContext, cert: Path, key: Path | None) -> None:
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key) if key is not None else None)
    except (ssl.SSLError, OSError, ValueError) as error:
        if key is None:
            raise TlsConfigError(
                f"--tls-cert {cert}: not a certificate with its private key in PEM (give the key with --tls-key "
                f"if it is in another file): {error}",
                option="--tls-cert",
            ) from None
        raise TlsConfigError(
            f"--tls-cert {cert} with --tls-key {key}: not a certificate and its private key in PEM: {error}",
            option="--tls-cert",
        ) from None


__all__ = ["OPTIONS", "TLS_HANDSHAKE_RECORD", "TLS_REQUIRED", "TlsConfigError", "TlsSettings"]
