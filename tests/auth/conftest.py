"""The tokens file of the authentication tests (their certificates: ``pki`` in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
servers = ["scheduler:*", "realtime:*"]

[[token]]
name = "shop"
token = "{PRODUCER}"
roles = ["producer"]

[[token]]
name = "billing"
token = "{CONSUMER}"
roles = ["consumer"]
groups = ["*"]

[[token]]
name = "orders-service"
token = "{ORDERS}"
roles = ["producer", "consumer"]
subjects = ["orders.*"]
groups = ["billing*"]
"""


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return path
