"""The sans-IO tokens table: parsing a tokens file, and what each token may do."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from delaymq.net.auth import (
    FORBIDDEN,
    UNAUTHORIZED,
    AuthRefusal,
    Identity,
    Scope,
    TokenFile,
    TokenFileError,
    parse_tokens,
)
from delaymq.protocol.commands import Command

from .conftest import CONSUMER, ORDERS, PRODUCER, SERVER, TOKENS

X = "x-secret-0123456789"
Y = "y-secret-0123456789"


def on(*subjects: str, group: str | None = None, server: tuple[str, str] | None = None) -> Scope:
    return Scope(subjects, group, server)


def test_each_token_may_send_what_its_roles_and_subjects_allow() -> None:
    table = parse_tokens(TOKENS)
    allowed = table.check(ORDERS, Command.SCHEDULE, on("orders.eu", "orders.us.paid"))
    assert isinstance(allowed, Identity) and allowed.name == "orders-service"
    assert isinstance(table.check(SERVER, Command.SEND, on("payments")), Identity)  # a scheduler delivering
    fenced = on("payments", server=("scheduler", "sched-1"))
    assert isinstance(table.check(SERVER, Command.SEND, fenced), Identity)
    assert isinstance(table.check(SERVER, Command.REGISTER, on(server=("realtime", "rt-1"))), Identity)
    assert isinstance(table.check(CONSUMER, Command.ROUTE), Identity)  # any token may ask for routes
    # a consumer's retry subject counts as the subject it carries, and its group must be the token's
    pull = on("%retry%billing%orders.eu", group="billing")
    assert isinstance(table.check(ORDERS, Command.PULL, pull), Identity)
    assert isinstance(table.check(ORDERS, Command.PULL, on("orders.eu", group="billing-eu")), Identity)


@pytest.mark.parametrize(
    ("token", "command", "scope", "code", "words"),
    [
        (None, Command.SEND, on("orders.eu"), UNAUTHORIZED, "no token"),
        ("wrong", Command.SEND, on("orders.eu"), UNAUTHORIZED, "unknown token"),
        (CONSUMER, Command.SCHEDULE, on("orders.eu"), FORBIDDEN, "role producer or server needed for SCHEDULE"),
        (
            ORDERS,
            Command.SEND,
            on("orders.eu", "payments"),
            FORBIDDEN,
            "subject 'payments' not allowed for 'orders-service'",
        ),
        (ORDERS, Command.PULL, on("%retry%billing%payments", group="billing"), FORBIDDEN, "not allowed"),
        (ORDERS, Command.CANCEL, Scope(None), FORBIDDEN, "by message ids"),
        (PRODUCER, Command.PULL, on("orders.eu"), FORBIDDEN, "role consumer needed for PULL"),
        (PRODUCER, Command.REGISTER, on(), FORBIDDEN, "role server needed for REGISTER"),
        (SERVER, Command.HANDOVER, on(), FORBIDDEN, "role admin needed for HANDOVER"),
        (SERVER, Command.SET_STATE, on(), FORBIDDEN, "role admin needed for SET_STATE"),
        # a producer may not carry a scheduler's fence, nor consume as another team's group
        (
            PRODUCER,
            Command.SEND,
            on("orders.eu", server=("scheduler", "sched-1")),
            FORBIDDEN,
            "may not act as server scheduler:sched-1: that needs role server",
        ),
        (ORDERS, Command.PULL, on("orders.eu", group="shipping"), FORBIDDEN, "consumer group 'shipping' not allowed"),
        (
            ORDERS,
            Command.ACK,
            on("%dead%shipping%orders.eu", group="billing"),
            FORBIDDEN,
            "belongs to consumer group 'shipping'",
        ),
    ],
)
def test_a_refusal_names_what_was_missing(
    token: str | None, command: Command, scope: Scope, code: str, words: str
) -> None:
    refusal = parse_tokens(TOKENS).check(token, command, scope)
    assert isinstance(refusal, AuthRefusal)
    assert refusal.code == code
    assert words in refusal.message
    assert refusal.error().code == code


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[[token]]\nname = 'a'\n token = ", "not TOML"),
        ("[[token]]\nname = 'a'\ntoken = 'x'\n", "[[token]] #1 (line 1): roles: missing"),
        (f"[[token]]\nname='a'\ntoken='{X}'\nroles=['x']\n", "roles: unknown role 'x'"),
        (f"[[token]]\nname='a'\ntoken='{X}'\nroles=['admin']\nsubjects=[]\n", "subjects: must be a non-empty list"),
        (f"[[token]]\nname='a'\ntoken='{X}'\nroles=['admin']\nrole='x'\n", "unknown field 'role'"),
        (
            f"[[token]]\nname='a'\ntoken='{X}'\nroles=['admin']\n\n[[token]]\nname='b'\ntoken='{X}'\nroles=['admin']\n",
            "[[token]] #2 (line 6): token: the same secret as token 'a'",
        ),
        (
            f"[[token]]\nname='a'\ntoken='{X}'\nroles=['admin']\n[[token]]\nname='a'\ntoken='{Y}'\nroles=['admin']\n",
            "name: 'a'",
        ),
        ("[tokens]\n", "unknown table or key 'tokens'"),
        ("", "holds no [[token]]"),
        ("[[token]]\nname='a'\ntoken='short-secret'\nroles=['admin']\n", "token: 12 characters, fewer than the 16"),
        ("[[token]]\nname='a'\ntoken_sha256='abc'\nroles=['admin']\n", "token_sha256: must be 64 hex digits"),
        (f"[[token]]\nname='a'\ntoken='{X}'\nroles=['consumer']\ngroups=[]\n", "groups: must be a non-empty list"),
        (
            f"[[token]]\nname='a'\ntoken='{X}'\nroles=['server']\nservers=['rt-1']\n",
            "servers: 'rt-1' is not kind:group",
        ),
        (
            f"[[token]]\nname='a'\ntoken='{X}'\nroles=['producer']\nservers=['realtime:rt-1']\n",
            "only a token with role server",
        ),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_the_line_or_field(text: str, words: str) -> None:
    with pytest.raises(TokenFileError) as refused:
        parse_tokens(text, source="tokens.toml")
    assert words in str(refused.value)
    assert str(refused.value).startswith("tokens.toml")


def test_a_token_may_be_given_as_its_sha256_so_the_file_holds_no_secret() -> None:
    digest = hashlib.sha256(X.encode()).hexdigest()
    table = parse_tokens(f"[[token]]\nname = 'ops'\ntoken_sha256 = '{digest}'\nroles = ['admin']\n")
    identity = table.check(X, Command.HANDOVER)
    assert isinstance(identity, Identity) and identity.name == "ops"
    assert isinstance(table.check(digest, Command.HANDOVER), AuthRefusal)  # the hash itself is no token


def test_a_reload_with_a_bad_file_keeps_the_old_table(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    tokens = TokenFile(path)
    path.write_text("[[token]]\nname = 'broken'\n")
    assert not tokens.reload()
    assert isinstance(tokens.table.check(PRODUCER, Command.SEND, on("payments")), Identity)
    path.write_text(TOKENS.replace('roles = ["producer"]', 'roles = ["consumer"]'))
    assert tokens.reload()
    assert isinstance(tokens.table.check(PRODUCER, Command.SEND, on("payments")), AuthRefusal)
