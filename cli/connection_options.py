"""The connection options every server command shares (``ConnectionLimits``).

``add_connection_options`` adds them to a server command's parser;
``connection_limits`` turns the parsed values into the ``ConnectionLimits`` a
server's ``Limits`` carries. Set in a TOML config file, they take the same text.
"""

from __future__ import annotations

import argparse
import re

from delaymq.cli import options
from delaymq.protocol.limits import DEFAULT_CONNECTION_LIMITS, ConnectionLimits

_SIZE = re.compile(r"(?P<number>\d+)\s*(?P<unit>|b|k|kb|kib|m|mb|mib|g|gb|gib)", re.IGNORECASE)
_UNIT_BYTES = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def size(text: str) -> int:
    """Bytes from "128MiB", "64m", "1g", "512KiB" or a plain number of bytes (units are powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match["number"]) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write a whole number of bytes of at least 1, or one with a unit "
            "KiB, MiB or GiB (e.g. 128MiB)"
        )
    return int(match["number"]) * _UNIT_BYTES[match["unit"][:1].lower()]


def count(text: str) -> int:
    """A whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    defaults = DEFAULT_CONNECTION_LIMITS
    parser.add_argument(
        "--max-connections",
        type=count,
        default=defaults.max_connections,
        metavar="N",
        help="connections open at once; a client past it is told 'unavailable' (default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=count,
        default=defaults.max_per_address,
        metavar="N",
        help="connections open at once from one client address (default: %(default)s)",
    )
    options.add_duration(
        parser,
        "--idle-timeout",
        options.show_duration(round(defaults.idle_timeout * 1000)),
        "close a connection with no request in flight and nothing received this long",
    )
    options.add_duration(
        parser,
        "--frame-timeout",
        options.show_duration(round(defaults.frame_timeout * 1000)),
        "close a connection whose request (or answer) takes longer than this to arrive",
    )
    parser.add_argument(
        "--max-buffered",
        type=size,
        metavar="SIZE",
        help="bytes of unfinished requests held across all connections (default: twice the frame limit, 128MiB)",
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The parsed options as ``ConnectionLimits``; ``ArgumentTypeError`` names a value out of range.

    Values from a config file may be numbers that no option type has seen, so
    everything is checked again here.
    """
    try:
        return ConnectionLimits(
            max_connections=args.max_connections,
            max_per_address=args.max_connections_per_address,
            idle_timeout=_seconds(args.idle_timeout, "--idle-timeout"),
            frame_timeout=_seconds(args.frame_timeout, "--frame-timeout"),
            max_buffered=args.max_buffered,
        )
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(value: float | str, option: str) -> float:
    seconds = options.duration_ms(value) / 1000
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{option} must be longer than 0, not {value!r}")
    return seconds


__all__ = ["add_connection_options", "connection_limits", "count", "size"]
