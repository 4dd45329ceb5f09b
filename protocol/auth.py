"""Who may do what: tokens with roles and subject patterns, sans-IO.

A tokens file (TOML) lists one ``[[token]]`` table per token::

    [[token]]
    name = "orders-service"          # who it is, in logs and refusals
    token = "8f3b...long random..."  # the secret the client presents
    roles = ["producer"]             # producer, consumer, admin, server
    subjects = ["orders.*"]          # optional; default ["*"]: every subject
    messages_per_s = 1000            # optional; default none: SEND/SCHEDULE messages a second
    bytes_per_s = 10_485_760         # optional; default none: SEND/SCHEDULE batch bytes a second

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
- PULL, ACK, NACK, CONSUMER_HEARTBEAT: consumer, for the subject(s) they name;
- REGISTER, HEARTBEAT, FETCH: server; SET_STATE: admin or server; HANDOVER: admin;
- PING, ROUTE, STATUS (and commands this table does not know): any token.

``TokenTable.check`` answers an ``Identity`` or an ``AuthRefusal`` naming what was
missing; ``TokenFile`` is the table of one file, reloaded in place (SIGHUP), so
the next request is checked against the new permissions. An identity's ``rates``
are enforced by the transport (``delaymq.protocol.ratelimit``) after this check.
"""

from __future__ import annotations

import hashlib
import logging
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.ratelimit import RATE_FIELDS
from delaymq.protocol.subjects import DEAD_PREFIX, RETRY_PREFIX, SEPARATOR

log = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "admin", "server")
#: A request without a token, or with one the table does not hold.
UNAUTHORIZED = "unauthorized"
#: A known token without the role or subject the request needs.
FORBIDDEN = "forbidden"
#: Every subject.
ALL_SUBJECTS = "*"

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
    Command.SET_STATE: frozenset({"admin", "server"}),
    Command.HANDOVER: _ADMIN,
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
    """Who a token is: its name, roles, subject patterns and rates (``RATE_FIELDS`` name → per second)."""

    name: str
    roles: frozenset[str]
    subjects: tuple[str, ...]
    rates: Mapping[str, float] = field(default_factory=dict, hash=False)

    def allows(self, subject: str) -> bool:
        checked = base_subject(subject)
        return any(fnmatchcase(checked, pattern) for pattern in self.subjects)

    @property
    def every_subject(self) -> bool:
        return ALL_SUBJECTS in self.subjects


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
    for prefix in (RETRY_PREFIX, DEAD_PREFIX):
        if subject.startswith(prefix):
            _group, sep, rest = subject[len(prefix) :].partition(SEPARATOR)
            if sep:
                return rest
    return subject


def _digest(token: str) -> bytes:
    # Tokens are looked up by digest: the lookup's timing says nothing about a secret's bytes.
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """The tokens of one file, looked up by the digest of the secret."""

    def __init__(self, identities: Mapping[str, Identity] | None = None) -> None:
        self._by_digest = {_digest(token): identity for token, identity in (identities or {}).items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def names(self) -> set[str]:
        return {identity.name for identity in self._by_digest.values()}

    def identify(self, token: str | None) -> Identity | None:
        return None if token is None else self._by_digest.get(_digest(token))

    def check(self, token: str | None, command: int, subjects: Iterable[str] | None = ()) -> Identity | AuthRefusal:
        """The identity ``token`` acts as, or why it may not send ``command`` for ``subjects``.

        ``subjects`` None: the request names messages without a subject (CANCEL by
        ids), which only a token allowed every subject may do.
        """
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
        needed = COMMAND_ROLES.get(command, _ANY)
        if needed and not needed & identity.roles:
            wanted = " or ".join(sorted(needed))
            return AuthRefusal(
                FORBIDDEN,
                f"role {wanted} needed for {name}; token {identity.name!r} has {', '.join(sorted(identity.roles))}",
                "role",
            )
        if command in SUBJECT_COMMANDS and not identity.every_subject:
            if subjects is None:
                return AuthRefusal(
                    FORBIDDEN,
                    f"{name}: by message ids names no subject, which only a token allowed every subject (*) may "
                    f"do; token {identity.name!r} is allowed {', '.join(identity.subjects)}: name the messages "
                    "by subject and key",
                    "subject",
                )
            for subject in subjects:
                if not identity.allows(subject):
                    base = base_subject(subject)
                    shown = repr(base) if base == subject else f"{base!r} (of {subject!r})"
                    return AuthRefusal(
                        FORBIDDEN,
                        f"{name}: subject {shown} not allowed for {identity.name!r} (allowed: "
                        f"{', '.join(identity.subjects)})",
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
    identities: dict[str, Identity] = {}
    names: set[str] = set()
    lines = _entry_lines(text)
    for index, entry in enumerate(entries):
        where = f"{source}: [[token]] #{index + 1}"
        if index < len(lines):
            where += f" (line {lines[index]})"
        token, identity = _entry(entry, where)
        if identity.name in names:
            raise TokenFileError(f"{where}: name: {identity.name!r} is used by another token")
        if token in identities:
            raise TokenFileError(f"{where}: token: the same secret as token {identities[token].name!r}")
        names.add(identity.name)
        identities[token] = identity
    return TokenTable(identities)


def _entry_lines(text: str) -> list[int]:
    """The line number of each ``[[token]]`` header, for errors."""
    return [number for number, line in enumerate(text.splitlines(), 1) if line.strip().startswith("[[token]]")]


def _entry(entry: Any, where: str) -> tuple[str, Identity]:
    if not isinstance(entry, dict):
        raise TokenFileError(f"{where}: not a table")
    known = ("name", "token", "roles", "subjects", *RATE_FIELDS)
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise TokenFileError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(known)})")
    for required in ("name", "token", "roles"):
        if required not in entry:
            raise TokenFileError(f"{where}: {required}: missing")
    name, token = entry["name"], entry["token"]
    for required, value in (("name", name), ("token", token)):
        if not isinstance(value, str) or not value.strip():
            raise TokenFileError(f"{where}: {required}: must be a non-empty string")
    roles = entry["roles"]
    if not isinstance(roles, list) or not roles:
        raise TokenFileError(f"{where} ({name}): roles: must be a non-empty list of {', '.join(ROLES)}")
    for role in roles:
        if role not in ROLES:
            raise TokenFileError(f"{where} ({name}): roles: unknown role {role!r} (roles: {', '.join(ROLES)})")
    subjects = entry.get("subjects", [ALL_SUBJECTS])
    if not isinstance(subjects, list) or not subjects:
        raise TokenFileError(f"{where} ({name}): subjects: must be a non-empty list of patterns such as 'orders.*'")
    for pattern in subjects:
        if not isinstance(pattern, str) or not pattern:
            raise TokenFileError(f"{where} ({name}): subjects: {pattern!r} is not a non-empty string")
    rates: dict[str, float] = {}
    for rate_field in RATE_FIELDS:
        rate = entry.get(rate_field)
        if rate is None:
            continue
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 1 <= rate < float("inf"):
            raise TokenFileError(f"{where} ({name}): {rate_field}: must be a number of at least 1, not {rate!r}")
        rates[rate_field] = float(rate)
    return token, Identity(name, frozenset(roles), tuple(subjects), rates)


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
    "ROLES",
    "SUBJECT_COMMANDS",
    "UNAUTHORIZED",
    "AuthRefusal",
    "Identity",
    "TokenFile",
    "TokenFileError",
    "TokenTable",
    "base_subject",
    "load_tokens",
    "parse_tokens",
]
