"""Option types shared by the subcommands: durations and addresses.

Each is an argparse ``type``: it turns the text into a value or raises
``ArgumentTypeError`` with a message saying what is accepted, which argparse
prints after the option's name. Values set in a TOML config file pass through
the same functions (strings) or ``duration_ms`` (plain numbers, in seconds).
``add_duration`` declares a duration option the one way every command does.
"""

from __future__ import annotations

import argparse
import math
import re

_DURATION = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s|m|h|d)?")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def duration(text: str) -> float:
    """Seconds from "500ms", "30s", "2m", "1h", "1d" or plain seconds ("1.5")."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: write a number of seconds, or one with a unit "
            "ms, s, m, h or d (e.g. 500ms, 30s, 2m)"
        )
    return float(match["number"]) * _UNIT_SECONDS[match["unit"]]


def delay(text: str) -> float:
    """``--delay``: a duration that may be negative ("-5s"): a moment in the past means "deliver now"."""
    stripped = text.strip()
    if stripped.startswith("-"):
        return -duration(stripped[1:])
    return duration(stripped)


def add_duration(parser: argparse.ArgumentParser, flag: str, default: str, help: str) -> None:
    """A duration option (``500ms``, ``30s``, ``2h``...) whose help ends with its default."""
    parser.add_argument(flag, type=duration, default=default, metavar="DURATION", help=f"{help} (default: {default})")


def duration_ms(value: float | int | str) -> int:
    """Whole milliseconds of a parsed duration (seconds), a config number (seconds) or text."""
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration")
    seconds = duration(value) if isinstance(value, str) else float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration of zero or more seconds")
    return round(seconds * 1000)


def show_duration(ms: int) -> str:
    """Milliseconds as the shortest text ``duration`` reads back: "30s", "500ms", "2m"."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _host_port(text: str, *, lowest_port: int) -> str:
    host, colon, port = text.strip().rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    if not colon or not bare or any(c.isspace() or c in "[]/" for c in bare):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (an IPv6 host goes in brackets: [::1]:20880)")
    if ":" in bare and not host.startswith("["):
        raise argparse.ArgumentTypeError(f"{text!r}: an IPv6 host goes in brackets, e.g. [{bare}]:{port}")
    if not (port.isascii() and port.isdigit()) or not lowest_port <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} has port {port!r}; a port is a number from {lowest_port} to 65535")
    return f"[{bare}]:{int(port)}" if ":" in bare else f"{bare}:{int(port)}"


def address(text: str) -> str:
    """A peer's "host:port" (port 1..65535), normalised."""
    return _host_port(text, lowest_port=1)


def listen_address(text: str) -> str:
    """An address to listen on: like ``address``, but port 0 asks for any free port."""
    return _host_port(text, lowest_port=0)


__all__ = ["add_duration", "address", "delay", "duration", "duration_ms", "listen_address", "show_duration"]
