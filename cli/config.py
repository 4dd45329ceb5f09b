"""The TOML config file: its keys mirror the command-line options.

Top-level keys set global options (``log-level = "debug"``); a table named after
a subcommand sets that subcommand's options (``[realtime] listen = "..."``).
Dashes and underscores are interchangeable in keys. Options given on the command
line win over the file. A key that names no option is an error, not ignored, so
a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """The config file is unreadable or names an option that does not exist."""


def load_config(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def _dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        action.dest: action
        for action in parser._actions
        if action.option_strings and action.dest not in ("help", "version", "config")
    }


def apply_config(
    parser: argparse.ArgumentParser,
    table: dict[str, Any],
    *,
    where: str,
) -> None:
    """Make the table's values the parser's defaults, refusing unknown keys."""
    dests = _dests(parser)
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            continue  # a subcommand's table, handled by its own parser
        dest = key.replace("-", "_")
        action = dests.get(dest)
        if action is None:
            known = ", ".join(sorted(d.replace("_", "-") for d in dests)) or "none"
            raise ConfigError(f"unknown option {key!r} in {where} (known: {known})")
        convert = action.type
        if callable(convert) and isinstance(value, str):
            try:
                value = convert(value)
            except (TypeError, ValueError) as error:
                raise ConfigError(f"bad value for {key!r} in {where}: {error}") from None
        defaults[dest] = value
    parser.set_defaults(**defaults)
