"""The server commands' connection options become the ``ConnectionLimits`` their server gets."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from delaymq.cli.connection_options import connection_limits, server_auth
from delaymq.cli.main import parse_args
from delaymq.net.limits import DEFAULT_CONNECTION_LIMITS, ConnectionLimits


@pytest.mark.parametrize("command", ["metaserver", "realtime", "scheduler"])
def test_defaults_are_the_transport_defaults(command: str) -> None:
    assert connection_limits(parse_args([command, "--data", "d"])) == DEFAULT_CONNECTION_LIMITS


def test_options_and_config_file_set_every_limit(tmp_path: Path) -> None:
    args = parse_args(
        [
            "realtime",
            "--data",
            "d",
            "--max-connections",
            "500",
            "--max-connections-per-address",
            "20",
            "--idle-timeout",
            "90s",
            "--frame-timeout",
            "500ms",
            "--max-buffered",
            "32MiB",
        ]
    )
    assert connection_limits(args) == ConnectionLimits(
        max_connections=500, max_per_address=20, idle_timeout=90.0, frame_timeout=0.5, max_buffered=32 << 20
    )
    config = tmp_path / "delaymq.toml"
    config.write_text('[scheduler]\nidle-timeout = 120\nmax-buffered = "1g"\n')
    limits = connection_limits(parse_args(["--config", str(config), "scheduler", "--data", "d"]))
    assert (limits.idle_timeout, limits.max_buffered) == (120.0, 1 << 30)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-connections", "0", "'0' is not a whole number of at least 1"),
        ("--max-buffered", "12q", "'12q' is not a size"),
        ("--idle-timeout", "soon", "'soon' is not a duration"),
    ],
)
def test_bad_values_are_refused_naming_the_option(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["metaserver", "--data", "d", option, value])
    err = capsys.readouterr().err
    assert option in err and message in err


def test_a_zero_timeout_from_a_config_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "delaymq.toml"
    config.write_text("[realtime]\nidle-timeout = 0\n")
    args = parse_args(["--config", str(config), "realtime", "--data", "d"])
    with pytest.raises(argparse.ArgumentTypeError, match="--idle-timeout must be longer than 0"):
        connection_limits(args)


@pytest.mark.parametrize(
    ("metrics", "insecure", "allowed"),
    [("127.0.0.1:9100", False, True), ("127.0.0.2:0", False, True), ("[::1]:9100", False, True),
     ("localhost:9100", False, True), ("0.0.0.0:9100", False, False), ("192.0.2.10:9180", False, False),
     ("0.0.0.0:9100", True, True)],
)  # fmt: skip
def test_without_a_tokens_file_metrics_are_served_on_loopback_only_unless_insecure_listen(
    metrics: str, insecure: bool, allowed: bool
) -> None:
    argv = ["realtime", "--data", "d", "--listen", "127.0.0.1:0", "--metrics-listen", metrics]
    args = parse_args([*argv, "--insecure-listen"] if insecure else argv)
    if allowed:
        assert server_auth(args, listen=args.listen)[1] is None
    else:
        with pytest.raises(
            argparse.ArgumentTypeError, match=f"--metrics-listen {re.escape(metrics)} is not a loopback"
        ):
            server_auth(args, listen=args.listen)


def test_with_a_tokens_file_metrics_may_be_served_on_any_address(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[token]]\nname = "ops"\ntoken = "ops-secret-0123456789"\nroles = ["admin"]\n')
    args = parse_args(["scheduler", "--data", "d", "--tokens-file", str(tokens), "--metrics-listen", "0.0.0.0:9100"])
    _own, table = server_auth(args, listen="0.0.0.0:20882")
    assert table is not None and table.table.names() == {"ops"}
