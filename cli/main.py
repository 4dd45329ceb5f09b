"""The ``delaymq`` command: one entry point, a subcommand per tool or server.

Each subcommand lives in its own module with ``add_parser(subparsers)``, which
registers its options and sets ``func`` to the code it runs. Logging is set up
once, here, before any subcommand runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from delaymq.cli import (
    admin_command,
    backlog_command,
    bench_command,
    cluster_command,
    consume_command,
    metaserver_command,
    realtime_command,
    scheduled_command,
    scheduler_command,
    send_command,
    status_command,
)
from delaymq.cli.config import ConfigError, apply_config, load_config
from delaymq.cli.parser import CommandParser
from delaymq.client.registration import software_version

log = logging.getLogger("delaymq")

#: Modules that contribute a subcommand, in the order ``--help`` lists them.
SUBCOMMANDS = [
    cluster_command,
    metaserver_command,
    realtime_command,
    scheduler_command,
    send_command,
    scheduled_command,
    consume_command,
    status_command,
    admin_command,
    bench_command,
    backlog_command,
]

LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = CommandParser(
        prog="delaymq",
        description=(
            "delaymq: a delay-message service. Schedule messages for any moment up to "
            "two years ahead; consumer groups receive them at that millisecond."
        ),
        epilog="Run 'delaymq COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"delaymq {software_version()}")
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="how much to log on standard error (default: %(default)s)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML file whose keys mirror the options; [COMMAND] tables hold a command's options",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser, dict(subparsers.choices)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line, with a ``--config`` file's values as defaults."""
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.config is not None:
        try:
            table = load_config(args.config)
            apply_config(parser, table, where=str(args.config))
            for name, sub in commands.items():
                section = table.get(name, {})
                if not isinstance(section, dict):
                    raise ConfigError(f"[{name}] in {args.config} must be a table")
                apply_config(sub, section, where=f"[{name}] of {args.config}")
            unknown = set(k for k, v in table.items() if isinstance(v, dict)) - set(commands)
            if unknown:
                raise ConfigError(f"unknown command table(s) {sorted(unknown)} in {args.config}")
        except ConfigError as error:
            parser.error(str(error))
        args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        parser.exit(2)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        log.info("interrupted")
        return 130


def entry() -> None:
    sys.exit(main())


__all__ = ["main", "build_parser", "entry"]
