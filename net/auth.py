"""Who may do what: tokens with roles and subject patterns, sans-IO.

A tokens file (TOML) lists one ``[[token]]`` table per token::

    [[token]]
    name = "orders-service"          # who it is, in logs and refusals
    token = "8f3b...long random..."  # the secret the client presents (16 characters at least)
    # token_sha256 = "..."           # or: the secret's SHA-256 in hex, so the file holds no secret
    roles = ["producer", "consumer"] # producer, consumer, admin, server, metrics
    subjects = ["orders.*"]          # optional; default ["*"]: every subject
    groups = ["billing*"]            # consumer groups it may PULL/ACK/NACK as; default none
    servers = ["scheduler:sched-1"]  # role server: the kind:group it may be; default none
    messages_per_s = 1000            # optional; default none: SEND/SCHEDULE messages a second
    bytes_per_s = 10_485_760         # optional; default none: SEND/SCHEDULE batch bytes a second
    requests_per_s = 500             # optional; default none: requests of any command a second

``subjects`` are shell-style patterns (``fnmatch``, case-sensitive): ``*`` matches
any run of characters, dots included (``orders.*`` matches ``orders.eu`` and
``orders.eu.paid``, not ``orders``), ``?`` one character, ``[...]`` a set. A
retry or dead-letter subject (``%retry%GROUP%S``, ``%dead%GROUP%S``) is checked as
the subject ``S`` it carries messages of.

Which roles a command needs (any one of them), ``COMMAND_ROLES``:

- SEND, SCHEDULE: producer (or server: a scheduler delivers with SEND, a realtime
  server schedules nacked messages with SCHEDULE), for the subject of every record;
- CANCEL, MOVE, QUERY: producer, for the subject they name; by message ids they
  name no subject, so only a token allowed every subject (``*``) may use them so;
- PULL, ACK, NACK, CONSUMER_HEARTBEAT: consumer, for the subject(s) and the
  consumer ``group`` they name (``groups`` patterns);
- REGISTER, HEARTBEAT, FETCH: server, as the ``kind:group`` the request is about
  (``servers`` patterns: REGISTER's own fields here, HEARTBEAT's and FETCH's in
  their handlers through ``require_server``); SET_STATE, HANDOVER, CLEAR_FENCE: admin;
- PING, ROUTE, STATUS (and commands this table does not know): any token.

A SEND that carries a scheduler's fence (``fence.group``) needs role server as
``scheduler:<group>``. A retry or dead-letter subject also needs its ``GROUP``
allowed by ``groups``, except for a server (which moves retries) or an admin.

``TokenTable.check`` answers an ``Identity`` or an ``AuthRefusal`` naming what was
missing; ``TokenFile`` is the table of one file, reloaded in place (SIGHUP), so
the next request is checked against the new permissions. An identity's ``rates``
are enforced by the transport (``delaymq.protocol.ratelimit``) after this check.
"""

from __future__ import annotations

import hashlib
import logging
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from delaymq.net.ratelimit import RATE_FIELDS
from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.subjects import carrier

log = logging.getLogger(__name__)

#: ``metrics`` may read a server's /metrics (with admin and server) and send only what any token may.
ROLES = ("producer", "consumer", "admin", "server", "metrics")
#: A request without a token, or with one the table does not hold.
UNAUTHORIZED = "unauthorized"
#: A known token without the role or subject the request needs.
FORBIDDEN = "forbidden"
#: Every subject.
ALL_SUBJECTS = "*"

#: Secrets shorter than this are refused when a tokens file is read.
MIN_TOKEN_LENGTH = 16

_PRODUCER = frozenset({"producer"})
_PRODUCER_OR_SERVER = frozenset({"producer", "server"})
_CONSUMER = frozenset({"consumer"})
_SERVER = frozenset({"server"})
_ADMIN = frozenset({"admin"})
_ANY: frozenset[str] = frozenset()

#: The roles that may send each command (any one of them); empty: any known token.
COMMAND_ROLES: Mapping[int, frozenset[str]] = {
    Command.PING: _ANY,
    Command.ROUTE: _ANY,
    Command.STATUS: _ANY,
    Command.REGISTER: _SERVER,
    Command.HEARTBEAT: _SERVER,
    Command.FETCH: _SERVER,
    Command.SET_STATE: _ADMIN,
    Command.HANDOVER: _ADMIN,
    Command.CLEAR_FENCE: _ADMIN,
    Command.SEND: _PRODUCER_OR_SERVER,
    Command.SCHEDULE: _PRODUCER_OR_SERVER,
    Command.CANCEL: _PRODUCER,
    Command.MOVE: _PRODUCER,
    Command.QUERY: _PRODUCER,
    Command.PULL: _CONSUMER,
    Command.ACK: _CONSUMER,
    Command.NACK: _CONSUMER,
    Command.CONSUMER_HEARTBEAT: _CONSUMER,
}
#: Commands whose consumer ``group`` is checked against the token's ``groups``.
GROUP_COMMANDS = frozenset({Command.PULL, Command.ACK, Command.NACK, Command.CONSUMER_HEARTBEAT})
#: Commands whose subjects are checked against the token's patterns.
SUBJECT_COMMANDS = frozenset(
    {
        Command.SEND,
        Command.SCHEDULE,
        Command.CANCEL,
        Command.MOVE,
        Command.QUERY,
        Command.PULL,
        Command.ACK,
        Command.NACK,
        Command.CONSUMER_HEARTBEAT,
    }
)


class TokenFileError(ValueError):
    """A tokens file that cannot be read or does not hold valid tokens; the message names the line or field."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a token is: its name, roles, patterns of subjects, consumer groups and
    servers (``kind:group``), and rates (``RATE_FIELDS`` name → per second)."""

    name: str
    roles: frozenset[str]
    subjects: tuple[str, ...]
    rates: Mapping[str, float] = field(default_factory=dict, hash=False)
    groups: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()

    def allows(self, subject: str) -> bool:
        """The subject, or the subject a retry or dead-letter subject carries, and its group."""
        checked = base_subject(subject)
        if not any(fnmatchcase(checked, pattern) for pattern in self.subjects):
            return False
        group = carrier_group(subject)
        return group is None or bool(self.roles & _TRUSTED_CARRIERS) or self.allows_group(group)

    def allows_group(self, group: str) -> bool:
        """May act as consumer group ``group`` (an admin may act as any)."""
        return "admin" in self.roles or any(fnmatchcase(group, pattern) for pattern in self.groups)

    def may_be(self, kind: str, group: str) -> bool:
        """May act as a server of ``kind`` (scheduler, realtime) in ``group``."""
        if "server" not in self.roles:
            return False
        member = f"{kind}:{group}"
        return any(fnmatchcase(member, pattern) for pattern in self.servers)

    @property
    def every_subject(self) -> bool:
        return ALL_SUBJECTS in self.subjects


#: Roles that may name any group's retry or dead-letter subject: a realtime server
#: schedules retries and dead letters under its own token; an admin reads them.
_TRUSTED_CARRIERS = frozenset({"server", "admin"})


@dataclass(frozen=True, slots=True)
class Scope:
    """What a request acts on, read from its frame before any handler runs.

    ``subjects`` None: messages named by id only; ``group`` the consumer group
    of a consumer command; ``server`` the ``(kind, group)`` a REGISTER or a
    fenced SEND speaks as (HEARTBEAT and FETCH are checked by their handlers).
    """

    subjects: tuple[str, ...] | None = ()
    group: str | None = None
    server: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class AuthRefusal:
    """Why a request is refused: ``code`` is ``unauthorized`` or ``forbidden``; ``field`` what was missing."""

    code: str
    message: str
    field: str

    def error(self) -> RemoteProtocolError:
        """The error the server answers with (the client reads it as a ``PeerError``; not retryable)."""
        return RemoteProtocolError(self.message, code=self.code, field=self.field)


def base_subject(subject: str) -> str:
    """The subject a retry or dead-letter subject carries messages of; other subjects as they are."""
    carried = carrier(subject)
    return subject if carried is None else carried[1]


def carrier_group(subject: str) -> str | None:
    """The consumer group a retry or dead-letter subject belongs to; None for other subjects."""
    carried = carrier(subject)
    return None if carried is None else carried[0]


def _digest(token: str) -> bytes:
    # Tokens are looked up by digest: the lookup's timing says nothing about a secret's bytes.
    return hashlib.sha256(token.encode()).digest()


def forbidden(message: str, field: str) -> RemoteProtocolError:
    return AuthRefusal(FORBIDDEN, message, field).error()


def require_server(identity: Identity | None, command: str, kind: str, group: str) -> None:
    """Raise ``forbidden`` unless ``identity`` may act as a server of ``kind`` in ``group``.

    None (a server without a tokens file) may do anything. For the handlers that
    learn the kind and group only from their own state (HEARTBEAT, FETCH).
    """
    if identity is not None and not identity.may_be(kind, group):
        raise forbidden(_server_message(identity, command, kind, group), "servers")


def _server_message(identity: Identity, command: str, kind: str, group: str) -> str:
    if "server" not in identity.roles:
        held = ", ".join(sorted(identity.roles))
        return (
            f"{command}: token {identity.name!r} may not act as server {kind}:{group}: that needs role server "
            f"and a servers pattern matching it (the token has roles {held})"
        )
    allowed = ", ".join(identity.servers) or "none"
    return f"{command}: token {identity.name!r} may not act as server {kind}:{group} (its servers: {allowed})"


class TokenTable:
    """The tokens of one file, looked up by the digest of the secret."""

    def __init__(self, identities: Mapping[str, Identity] | None = None) -> None:
        self._by_digest = {_digest(token): identity for token, identity in (identities or {}).items()}

    @classmethod
    def of_digests(cls, identities: Mapping[bytes, Identity]) -> TokenTable:
        """A table of identities by the SHA-256 digest of their secrets."""
        table = cls()
        table._by_digest = dict(identities)
        return table

    def __len__(self) -> int:
        return len(self._by_digest)

    def names(self) -> set[str]:
        return {identity.name for identity in self._by_digest.values()}

    def identify(self, token: str | None) -> Identity | None:
        return None if token is None else self._by_digest.get(_digest(token))

    def check(self, token: str | None, command: int, scope: Scope = Scope()) -> Identity | AuthRefusal:
        """The identity ``token`` acts as, or why it may not send ``command`` on ``scope``."""
        name = command_name(command)
        if token is None:
            return AuthRefusal(
                UNAUTHORIZED,
                f"{name}: no token: this server requires one (--token TOKEN or DELAYMQ_TOKEN; "
                "Limits(token=...) from Python)",
                "token",
            )
        identity = self.identify(token)
        if identity is None:
            return AuthRefusal(
                UNAUTHORIZED, f"{name}: unknown token: this server's tokens file does not hold it", "token"
            )
        return decide(identity, command, scope)


def decide(identity: Identity, command: int, scope: Scope) -> Identity | AuthRefusal:
    """``identity`` if it may send ``command`` on ``scope``, else why not (always ``forbidden``)."""
    name = command_name(command)
    needed = COMMAND_ROLES.get(command, _ANY)
    if needed and not needed & identity.roles:
        wanted = " or ".join(sorted(needed))
        return AuthRefusal(
            FORBIDDEN,
            f"role {wanted} needed for {name}; token {identity.name!r} has {', '.join(sorted(identity.roles))}",
            "role",
        )
    if scope.server is not None and not identity.may_be(*scope.server):
        return AuthRefusal(FORBIDDEN, _server_message(identity, name, *scope.server), "servers")
    if command in GROUP_COMMANDS and scope.group is not None and not identity.allows_group(scope.group):
        allowed = ", ".join(identity.groups) or "none: give the token groups = [...]"
        return AuthRefusal(
            FORBIDDEN,
            f"{name}: consumer group {scope.group!r} not allowed for {identity.name!r} (allowed: {allowed})",
            "group",
        )
    if command in SUBJECT_COMMANDS:
        return _check_subjects(identity, name, scope.subjects)
    return identity


def _check_subjects(identity: Identity, name: str, subjects: tuple[str, ...] | None) -> Identity | AuthRefusal:
    if subjects is None:
        if identity.every_subject:
            return identity
        return AuthRefusal(
            FORBIDDEN,
            f"{name}: by message ids names no subject, which only a token allowed every subject (*) may "
            f"do; token {identity.name!r} is allowed {', '.join(identity.subjects)}: name the messages "
            "by subject and key",
            "subject",
        )
    for subject in subjects:
        if identity.allows(subject):
            continue
        base = base_subject(subject)
        if base != subject and any(fnmatchcase(base, pattern) for pattern in identity.subjects):
            allowed = ", ".join(identity.groups) or "none"
            return AuthRefusal(
                FORBIDDEN,
                f"{name}: subject {subject!r} belongs to consumer group {carrier_group(subject)!r}, not allowed "
                f"for {identity.name!r} (allowed groups: {allowed})",
                "group",
            )
        shown = repr(base) if base == subject else f"{base!r} (of {subject!r})"
        return AuthRefusal(
            FORBIDDEN,
            f"{name}: subject {shown} not allowed for {identity.name!r} (allowed: {', '.join(identity.subjects)})",
            "subject",
        )
    return identity


def parse_tokens(text: str, *, source: str = "tokens file") -> TokenTable:
    """The table a tokens file's text holds; ``TokenFileError`` names the line or the entry and field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TokenFileError(f"{source}: not TOML: {error}") from None
    unknown = sorted(set(data) - {"token"})
    if unknown:
        raise TokenFileError(f"{source}: unknown table or key {unknown[0]!r}: the file holds [[token]] tables only")
    entries = data.get("token", [])
    if not isinstance(entries, list):
        raise TokenFileError(f"{source}: token must be an array of tables ([[token]]), not a {type(entries).__name__}")
    if not entries:
        raise TokenFileError(
            f"{source}: holds no [[token]]: every request would be refused; add tokens, or start the server "
            "without --tokens-file (loopback only)"
        )
    identities: dict[bytes, Identity] = {}
    names: set[str] = set()
    lines = _entry_lines(text)
    for index, entry in enumerate(entries):
        where = f"{source}: [[token]] #{index + 1}"
        if index < len(lines):
            where += f" (line {lines[index]})"
        digest, identity = _entry(entry, where)
        if identity.name in names:
            raise TokenFileError(f"{where}: name: {identity.name!r} is used by another token")
        if digest in identities:
            raise TokenFileError(f"{where}: token: the same secret as token {identities[digest].name!r}")
        names.add(identity.name)
        identities[digest] = identity
    return TokenTable.of_digests(identities)


def _entry_lines(text: str) -> list[int]:
    """The line number of each ``[[token]]`` header, for errors."""
    return [number for number, line in enumerate(text.splitlines(), 1) if line.strip().startswith("[[token]]")]


_PATTERN_FIELDS = {
    "subjects": "subject patterns such as 'orders.*'",
    "groups": "consumer group patterns such as 'billing*'",
    "servers": "kind:group patterns such as 'scheduler:sched-1' or 'realtime:rt-*'",
}


def _entry(entry: Any, where: str) -> tuple[bytes, Identity]:
    if not isinstance(entry, dict):
        raise TokenFileError(f"{where}: not a table")
    known = ("name", "token", "token_sha256", "roles", *_PATTERN_FIELDS, *RATE_FIELDS)
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise TokenFileError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(known)})")
    for required in ("name", "token", "roles"):
        if required not in entry and (required != "token" or "token_sha256" not in entry):
            raise TokenFileError(f"{where}: {required}: missing")
    name = entry["name"]
    if not isinstance(name, str) or not name.strip():
        raise TokenFileError(f"{where}: name: must be a non-empty string")
    digest = _secret_digest(entry, where)
    where = f"{where} ({name})"
    roles = entry["roles"]
    if not isinstance(roles, list) or not roles:
        raise TokenFileError(f"{where}: roles: must be a non-empty list of {', '.join(ROLES)}")
    for role in roles:
        if role not in ROLES:
            raise TokenFileError(f"{where}: roles: unknown role {role!r} (roles: {', '.join(ROLES)})")
    patterns = {key: _patterns(entry, key, where) for key in _PATTERN_FIELDS}
    for server in patterns["servers"]:
        if ":" not in server and server != "*":
            raise TokenFileError(
                f"{where}: servers: {server!r} is not kind:group (such as 'realtime:rt-*'), nor * (every server)"
            )
    if patterns["servers"] and "server" not in roles:
        raise TokenFileError(f"{where}: servers: only a token with role server may name servers")
    rates: dict[str, float] = {}
    for rate_field in RATE_FIELDS:
        rate = entry.get(rate_field)
        if rate is None:
            continue
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 1 <= rate < float("inf"):
            raise TokenFileError(f"{where}: {rate_field}: must be a number of at least 1, not {rate!r}")
        rates[rate_field] = float(rate)
    subjects = patterns["subjects"] or (ALL_SUBJECTS,)
    return digest, Identity(
        name, frozenset(roles), subjects, rates, groups=patterns["groups"], servers=patterns["servers"]
    )


def _secret_digest(entry: Mapping[str, Any], where: str) -> bytes:
    """The SHA-256 of the entry's secret: ``token`` (16 characters at least) or ``token_sha256`` (hex)."""
    if "token" in entry and "token_sha256" in entry:
        raise TokenFileError(f"{where}: token: give token or token_sha256, not both")
    if "token_sha256" in entry:
        value = entry["token_sha256"]
        try:
            digest = bytes.fromhex(value) if isinstance(value, str) else b""
        except ValueError:
            digest = b""
        if len(digest) != hashlib.sha256().digest_size:
            raise TokenFileError(
                f"{where}: token_sha256: must be 64 hex digits (printf %s SECRET | sha256sum), not {value!r}"
            )
        return digest
    token = entry["token"]
    if not isinstance(token, str) or not token.strip():
        raise TokenFileError(f"{where}: token: must be a non-empty string")
    if len(token) < MIN_TOKEN_LENGTH:
        raise TokenFileError(
            f"{where}: token: {len(token)} characters, fewer than the {MIN_TOKEN_LENGTH} a secret needs "
            "(make one with: openssl rand -hex 32)"
        )
    return _digest(token)


def _patterns(entry: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list) or (key in entry and not value):
        raise TokenFileError(f"{where}: {key}: must be a non-empty list of {_PATTERN_FIELDS[key]}")
    for pattern in value:
        if not isinstance(pattern, str) or not pattern:
            raise TokenFileError(f"{where}: {key}: {pattern!r} is not a non-empty string")
    return tuple(value)


def load_tokens(path: Path) -> TokenTable:
    """The table of the tokens file at ``path``; ``TokenFileError`` if it cannot be read or is not valid."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise TokenFileError(f"--tokens-file {path}: cannot read it: {reason}") from None
    return parse_tokens(text, source=f"--tokens-file {path}")


class TokenFile:
    """The table of a tokens file, which ``reload`` replaces in place (the server's SIGHUP).

    Every request is checked against ``table`` as it is then, so new permissions
    apply to the next request, on connections already open too.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.table = load_tokens(self.path)
        self.reloads = 0

    def reload(self) -> bool:
        """Read the file again; a bad file is logged and the old table kept (False)."""
        try:
            table = load_tokens(self.path)
        except TokenFileError as error:
            log.error("kept the previous tokens (%d token(s)): %s", len(self.table), error)
            return False
        self.table = table
        self.reloads += 1
        log.info("reloaded %d token(s) from %s", len(table), self.path)
        return True

    def describe(self) -> str:
        return f"{len(self.table)} token(s) from {self.path}"


__all__ = [
    "ALL_SUBJECTS",
    "COMMAND_ROLES",
    "FORBIDDEN",
    "GROUP_COMMANDS",
    "MIN_TOKEN_LENGTH",
    "ROLES",
    "SUBJECT_COMMANDS",
    "UNAUTHORIZED",
    "AuthRefusal",
    "Identity",
    "Scope",
    "TokenFile",
    "TokenFileError",
    "TokenTable",
    "base_subject",
    "carrier_group",
    "decide",
    "forbidden",
    "load_tokens",
    "parse_tokens",
    "require_server",
]
