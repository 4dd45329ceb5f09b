"""The sans-IO tokens table: parsing a tokens file, and what each token may do."""

from __future__ import annotations

from pathlib import Path

import pytest

from delaymq.protocol.auth import (
    FORBIDDEN,
    UNAUTHORIZED,
    AuthRefusal,
    Identity,
    TokenFile,
    TokenFileError,
    parse_tokens,
)
from delaymq.protocol.commands import Command

from .conftest import CONSUMER, ORDERS, PRODUCER, SERVER, TOKENS


def test_each_token_may_send_what_its_roles_and_subjects_allow() -> None:
    table = parse_tokens(TOKENS)
    allowed = table.check(ORDERS, Command.SCHEDULE, ["orders.eu", "orders.us.paid"])
    assert isinstance(allowed, Identity) and allowed.name == "orders-service"
    assert isinstance(table.check(SERVER, Command.SEND, ["payments"]), Identity)  # a scheduler delivering
    assert isinstance(table.check(SERVER, Command.REGISTER), Identity)
    assert isinstance(table.check(CONSUMER, Command.ROUTE), Identity)  # any token may ask for routes
    # a consumer's retry subject counts as the subject it carries
    assert isinstance(table.check(ORDERS, Command.PULL, ["%retry%billing%orders.eu"]), Identity)


@pytest.mark.parametrize(
    ("token", "command", "subjects", "code", "words"),
    [
        (None, Command.SEND, ["orders.eu"], UNAUTHORIZED, "no token"),
        ("wrong", Command.SEND, ["orders.eu"], UNAUTHORIZED, "unknown token"),
        (CONSUMER, Command.SCHEDULE, ["orders.eu"], FORBIDDEN, "role producer or server needed for SCHEDULE"),
        (
            ORDERS,
            Command.SEND,
            ["orders.eu", "payments"],
            FORBIDDEN,
            "subject 'payments' not allowed for 'orders-service'",
        ),
        (ORDERS, Command.PULL, ["%retry%billing%payments"], FORBIDDEN, "not allowed"),
        (ORDERS, Command.CANCEL, None, FORBIDDEN, "by message ids"),
        (PRODUCER, Command.PULL, ["orders.eu"], FORBIDDEN, "role consumer needed for PULL"),
        (PRODUCER, Command.REGISTER, [], FORBIDDEN, "role server needed for REGISTER"),
        (SERVER, Command.HANDOVER, [], FORBIDDEN, "role admin needed for HANDOVER"),
    ],
)
def test_a_refusal_names_what_was_missing(
    token: str | None, command: Command, subjects: list[str] | None, code: str, words: str
) -> None:
    refusal = parse_tokens(TOKENS).check(token, command, subjects)
    assert isinstance(refusal, AuthRefusal)
    assert refusal.code == code
    assert words in refusal.message
    assert refusal.error().code == code


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[[token]]\nname = 'a'\n token = ", "not TOML"),
        ("[[token]]\nname = 'a'\ntoken = 'x'\n", "[[token]] #1 (line 1): roles: missing"),
        ("[[token]]\nname='a'\ntoken='x'\nroles=['x']\n", "roles: unknown role 'x'"),
        ("[[token]]\nname='a'\ntoken='x'\nroles=['admin']\nsubjects=[]\n", "subjects: must be a non-empty list"),
        ("[[token]]\nname='a'\ntoken='x'\nroles=['admin']\nrole='x'\n", "unknown field 'role'"),
        (
            "[[token]]\nname='a'\ntoken='x'\nroles=['admin']\n\n[[token]]\nname='b'\ntoken='x'\nroles=['admin']\n",
            "[[token]] #2 (line 6): token: the same secret as token 'a'",
        ),
        (
            "[[token]]\nname='a'\ntoken='x'\nroles=['admin']\n[[token]]\nname='a'\ntoken='y'\nroles=['admin']\n",
            "name: 'a'",
        ),
        ("[tokens]\n", "unknown table or key 'tokens'"),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_the_line_or_field(text: str, words: str) -> None:
    with pytest.raises(TokenFileError) as refused:
        parse_tokens(text, source="tokens.toml")
    assert words in str(refused.value)
    assert str(refused.value).startswith("tokens.toml")


def test_a_reload_with_a_bad_file_keeps_the_old_table(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    tokens = TokenFile(path)
    path.write_text("[[token]]\nname = 'broken'\n")
    assert not tokens.reload()
    assert isinstance(tokens.table.check(PRODUCER, Command.SEND, ["payments"]), Identity)
    path.write_text(TOKENS.replace('roles = ["producer"]', 'roles = ["consumer"]'))
    assert tokens.reload()
    assert isinstance(tokens.table.check(PRODUCER, Command.SEND, ["payments"]), AuthRefusal)
