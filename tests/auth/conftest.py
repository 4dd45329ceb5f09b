"""The tokens file of the authentication tests (their certificates: ``pki`` in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..support.tokens import CONSUMER, SERVERS_TOKEN, SHOP_TOKEN, token, tokens_toml
from ..support.tokens import PRODUCER as PRODUCER  # the tests' own imports of the secrets
from ..support.tokens import SERVER as SERVER

ORDERS = "orders-secret-0123456789"

TOKENS = tokens_toml(
    SERVERS_TOKEN,
    SHOP_TOKEN,
    token("billing", CONSUMER, ["consumer"], groups=["*"]),
    token("orders-service", ORDERS, ["producer", "consumer"], subjects=["orders.*"], groups=["billing*"]),
)


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return path
