"""The connection options every server command shares (``ConnectionLimits``), and TLS.

``add_connection_options`` adds them to a server command's parser;
``connection_limits`` turns the parsed values into the ``ConnectionLimits`` a
server's ``Limits`` carries. Set in a TOML config file, they take the same text.
``add_tls_options`` adds ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (and, to a
server's parser, ``--tls-require-client-cert``) to a server's or a client's
command; ``tls_settings`` reads them into the ``TlsSettings`` of ``Limits.tls``.
It adds ``--token`` too (``Limits.token``, default ``$DELAYMQ_TOKEN``), and to a
server ``--tokens-file`` and ``--insecure-listen``: ``server_auth`` reads them and
refuses a listener or a metrics endpoint off loopback that checks no token.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
from pathlib import Path

from delaymq.cli import options
from delaymq.net.addresses import split_listen
from delaymq.net.auth import TokenFile, TokenFileError
from delaymq.net.limits import DEFAULT_CONNECTION_LIMITS, ConnectionLimits, Limits
from delaymq.net.tls import TlsConfigError, TlsSettings

log = logging.getLogger("delaymq")

#: The environment variable a client's (or a server's own) token may come from instead of ``--token``.
TOKEN_ENV = "DELAYMQ_TOKEN"

_SIZE = re.compile(r"(?P<number>\d+)\s*(?P<unit>|b|k|kb|kib|m|mb|mib|g|gb|gib)", re.IGNORECASE)
_UNIT_BYTES = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def size(text: str) -> int:
    """Bytes from "128MiB", "64m", "1g", "512KiB" or a plain number of bytes (units are powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match["number"]) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write a whole number of bytes of at least 1, or one with a unit "
            "KiB, MiB or GiB (e.g. 128MiB)"
        )
    return int(match["number"]) * _UNIT_BYTES[match["unit"][:1].lower()]


def count(text: str) -> int:
    """A whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    defaults = DEFAULT_CONNECTION_LIMITS
    parser.add_argument(
        "--max-connections",
        type=count,
        default=defaults.max_connections,
        metavar="N",
        help="connections open at once; a client past it is told 'unavailable' (default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=count,
        default=defaults.max_per_address,
        metavar="N",
        help="connections open at once from one client address (default: %(default)s)",
    )
    options.add_duration(
        parser,
        "--idle-timeout",
        options.show_duration(round(defaults.idle_timeout * 1000)),
        "close a connection with no request in flight and nothing received this long",
    )
    options.add_duration(
        parser,
        "--frame-timeout",
        options.show_duration(round(defaults.frame_timeout * 1000)),
        "close a connection whose request (or answer) takes longer than this to arrive",
    )
    parser.add_argument(
        "--max-buffered",
        type=size,
        metavar="SIZE",
        help="bytes of unfinished requests held across all connections (default: twice the frame limit, 128MiB)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=count,
        default=defaults.max_in_flight,
        metavar="N",
        help="requests one connection may have in flight; at it the server reads no more from that connection "
        "until one is answered (back-pressure, not a refusal) (default: %(default)s)",
    )
    add_tls_options(parser, server=True)


def add_tls_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca``; a server's also ``--tls-require-client-cert``."""
    if server:
        cert_help = (
            "TLS: this server's certificate (PEM), shown to its clients and presented as the client "
            "certificate of its own connections; the listener takes TLS only (default: plaintext)"
        )
        ca_help = (
            "TLS: the CA (PEM) that signs the servers' certificates: the servers this one connects to are "
            "verified against it, and so are client certificates"
        )
    else:
        cert_help = "TLS: the client certificate (PEM) to present to the servers (default: none)"
        ca_help = (
            "TLS: the CA (PEM) that signs the servers' certificates; giving it connects with TLS and "
            "verifies every server against it (default: plaintext)"
        )
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help=cert_help)
    parser.add_argument(
        "--tls-key", type=Path, metavar="FILE", help="TLS: the private key (PEM) of --tls-cert, if not in that file"
    )
    parser.add_argument("--tls-ca", type=Path, metavar="FILE", help=ca_help)
    if server:
        parser.add_argument(
            "--tls-require-client-cert",
            action="store_true",
            help="TLS: refuse a client (or server) that presents no certificate signed by --tls-ca",
        )
    add_auth_options(parser, server=server)


def add_auth_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """``--token``; a server's also ``--tokens-file`` and ``--insecure-listen`` (docs/operations.md)."""
    who = "this server's own token, presented to the metaserver and the other servers (role server)" if server else (
        "the token presented to the servers"
    )  # fmt: skip
    parser.add_argument("--token", metavar="TOKEN", help=f"{who} (default: ${TOKEN_ENV}; none)")
    if not server:
        return
    parser.add_argument(
        "--tokens-file",
        type=Path,
        metavar="FILE",
        help="the tokens (TOML) whose roles and subjects every request is checked against, and of which a "
        "scrape of --metrics-listen must present one of role admin or server (Authorization: Bearer TOKEN); "
        "reloaded on SIGHUP (default: none: anyone who reaches the listener may do anything, so it must be "
        "on loopback)",
    )
    parser.add_argument(
        "--insecure-listen",
        action="store_true",
        help="listen (and serve --metrics-listen) on a non-loopback address without --tokens-file (anyone who "
        "reaches it may do anything)",
    )


def tls_settings(args: argparse.Namespace, *, server: bool) -> TlsSettings | None:
    """The TLS options as ``TlsSettings`` (None: plaintext); ``ArgumentTypeError`` names a bad option."""
    try:
        return _tls_settings(args, server=server)
    except TlsConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def client_limits(args: argparse.Namespace) -> Limits:
    """The ``Limits`` of a client command: the defaults, TLS from its options.

    ``TlsConfigError`` (a ``ValueError``) names an option whose file is missing or unreadable.
    """
    return Limits(tls=_tls_settings(args, server=False), token=token(args))


def token(args: argparse.Namespace) -> str | None:
    """``--token``, else ``$DELAYMQ_TOKEN``, else None."""
    given = getattr(args, "token", None) or os.environ.get(TOKEN_ENV) or ""
    return given.strip() or None


def server_auth(args: argparse.Namespace, *, listen: str) -> tuple[str | None, TokenFile | None]:
    """A server's own token and its tokens file; ``ArgumentTypeError`` for a bad file, or for a
    listener or a metrics endpoint (``--metrics-listen``) off loopback without one (unless
    ``--insecure-listen``). Logs what it decided."""
    path = getattr(args, "tokens_file", None)
    if path is not None:
        tokens = load_tokens_file(Path(path))
        log.info("checking every request against %s (reloaded on SIGHUP)", tokens.describe())
        return token(args), tokens
    insecure = bool(getattr(args, "insecure_listen", False))
    _check_unauthenticated("--listen", listen, insecure, "send, consume and administer")
    metrics = getattr(args, "metrics_listen", None)
    if metrics is not None:
        _check_unauthenticated(
            "--metrics-listen", metrics, insecure, "read the servers' addresses, groups and subjects"
        )
    if is_loopback(split_listen(listen)[0]):
        log.info("no --tokens-file: %s is on loopback, where every local client may do anything", listen)
    return token(args), None


def load_tokens_file(path: Path) -> TokenFile:
    """The tokens file at ``path``; ``ArgumentTypeError`` (one line naming the file, entry and field) if it
    cannot be read or holds no valid tokens (none at all, or a secret shorter than 16 characters)."""
    try:
        return TokenFile(path)
    except TokenFileError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _check_unauthenticated(option: str, address: str, insecure: bool, could: str) -> None:
    """Refuse ``address`` off loopback (it checks no token), unless ``insecure`` (then warn)."""
    if is_loopback(split_listen(address)[0]):
        return
    if not insecure:
        raise argparse.ArgumentTypeError(
            f"{option} {address} is not a loopback address and no --tokens-file is given: anyone who reaches "
            f"it could {could}. Give --tokens-file FILE, or --insecure-listen to serve it anyway"
        )
    log.warning("no --tokens-file: %s serves anyone who reaches it (--insecure-listen)", address)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); a name other than that is not."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _tls_settings(args: argparse.Namespace, *, server: bool) -> TlsSettings | None:
    """A server needs ``--tls-cert`` for any TLS: its listener cannot take TLS without
    one, and a cluster is TLS or plaintext throughout."""
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
    require = bool(getattr(args, "tls_require_client_cert", False))
    if cert is None and key is None and ca is None and not require:
        return None
    if server and cert is None:
        given = "--tls-key" if key is not None else "--tls-ca" if ca is not None else "--tls-require-client-cert"
        raise TlsConfigError(
            f"{given} needs --tls-cert (and --tls-key): a server's listener takes TLS only with a certificate",
            option="--tls-cert",
        )
    return TlsSettings(cert=_path(cert), key=_path(key), ca=_path(ca), require_client_cert=require)


def _path(value: Path | str | None) -> Path | None:
    """A file option's value: a ``Path`` from the command line, a string from a config file."""
    return None if value is None else Path(value)


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The parsed options as ``ConnectionLimits``; ``ArgumentTypeError`` names a value out of range.

    Values from a config file may be numbers that no option type has seen, so
    everything is checked again here.
    """
    try:
        return ConnectionLimits(
            max_connections=args.max_connections,
            max_per_address=args.max_connections_per_address,
            idle_timeout=_seconds(args.idle_timeout, "--idle-timeout"),
            frame_timeout=_seconds(args.frame_timeout, "--frame-timeout"),
            max_buffered=args.max_buffered,
            max_in_flight=args.max_in_flight,
        )
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(value: float | str, option: str) -> float:
    seconds = options.duration_ms(value) / 1000
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{option} must be longer than 0, not {value!r}")
    return seconds


__all__ = [
    "TOKEN_ENV",
    "add_auth_options",
    "add_connection_options",
    "add_tls_options",
    "client_limits",
    "connection_limits",
    "count",
    "is_loopback",
    "load_tokens_file",
    "server_auth",
    "size",
    "token",
    "tls_settings",
]
