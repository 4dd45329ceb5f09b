"""The ``delaymq`` command line: help, version, logging level and config files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from delaymq.cli.main import build_parser, main, parse_args


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    _, commands = build_parser()
    for name in commands:
        assert name in out
    assert "--log-level" in out and "--config" in out


@pytest.mark.parametrize("name", list(build_parser()[1]))
def test_each_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: delaymq {name}" in capsys.readouterr().out


def test_version_is_the_installed_distribution() -> None:
    from importlib.metadata import version

    out = subprocess.run(
        [sys.executable, "-P", "-m", "delaymq.cli", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == f"delaymq {version('delaymq')}"


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    assert exit_info.value.code == 2
    assert "usage: delaymq" in capsys.readouterr().out


def test_config_file_sets_global_and_command_options(tmp_path: Path) -> None:
    config = tmp_path / "delaymq.toml"
    config.write_text('log-level = "debug"\n[bench]\ndir = "/scratch"\n')
    args = parse_args(["--config", str(config), "bench", "codec"])
    assert args.log_level == "debug"
    assert args.dir == Path("/scratch")


def test_command_line_wins_over_config_file(tmp_path: Path) -> None:
    config = tmp_path / "delaymq.toml"
    config.write_text('log_level = "debug"\n')
    args = parse_args(["--config", str(config), "--log-level", "error", "bench"])
    assert args.log_level == "error"


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("log-levle = 'debug'\n", "unknown option 'log-levle'"),
        ("[bench]\nspeed = 3\n", "unknown option 'speed' in [bench]"),
        ("[nosuchcommand]\nx = 1\n", "unknown command table"),
        ("log-level = \n", "not valid TOML"),
    ],
)
def test_bad_config_is_refused_with_the_key_named(
    tmp_path: Path, text: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "delaymq.toml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", str(config), "bench"])
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_missing_config_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "absent.toml"), "bench"])
    assert "absent.toml does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["send", "--count", "many", "orders", "hi"], "--count"),
        (["send", "--delay", "soon", "orders", "hi"], "--delay"),
        (["send", "orders"], "BODY"),
        (["consume", "orders", "--from", "middle"], "--from"),
        (["nonsense"], "COMMAND"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_argument(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert named in err and "--help" in err


@pytest.mark.parametrize(
    ("argv", "seconds"),
    [
        (["--delay", "-5s"], -5.0),
        (["--delay=-5s"], -5.0),
        (["--delay", "-500ms"], -0.5),
        (["--delay", "-2"], -2.0),
        (["--delay", "90s"], 90.0),
    ],
)
def test_a_negative_delay_is_a_value_not_an_option(argv: list[str], seconds: float) -> None:
    args = parse_args(["send", *argv, "orders", "hi"])
    assert args.delay == seconds and (args.subject, args.body) == ("orders", "hi")
