"""Tokens files for the tests: the secrets several folders present, and ``token``/``tokens_toml`` to write
the ``[[token]]`` tables (docs/security.md) without copying their TOML from test to test."""

from __future__ import annotations

import json

SERVER = "server-secret-0123456789"
PRODUCER = "producer-secret-0123456789"
CONSUMER = "consumer-secret-0123456789"
ADMIN = "admin-secret-0123456789"


def token(name: str, secret: str, roles: list[str], **fields: list[str] | int) -> str:
    """One ``[[token]]`` table: ``name``, ``token``, ``roles``, then ``fields`` in their order (``servers``,
    ``subjects``, ``groups``, rates...)."""
    lines = ["[[token]]", f'name = "{name}"', f'token = "{secret}"', f"roles = {json.dumps(roles)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def tokens_toml(*tables: str) -> str:
    """The text of a tokens file holding ``tables`` (``token(...)``), a blank line before each."""
    return "".join("\n" + table for table in tables)


#: Every scheduler and realtime server, one token.
SERVERS_TOKEN = token("servers", SERVER, ["server"], servers=["scheduler:*", "realtime:*"])
#: A producer of any subject.
SHOP_TOKEN = token("shop", PRODUCER, ["producer"])
#: The admin.
OPS_TOKEN = token("ops", ADMIN, ["admin"])
