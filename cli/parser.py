"""The argument parser every ``delaymq`` command is built with.

Two departures from plain argparse, both for the person at the shell:

- a usage error is one line (``delaymq send: argument --count: ... (see
  'delaymq send --help')``), not the whole usage block before it;
- an option value that starts with a minus and a digit (``--delay -5s``) is a
  value, not an unknown option: argparse only allows that for bare numbers.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

#: "-5", "-1.5", "-5s", "-500ms": values, never option names (no option is spelled so).
_NEGATIVE_VALUE = re.compile(r"^-(\d+\.?\d*|\.\d+)[a-z]*$")


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line usage errors and negative durations."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # argparse asks this pattern whether "-5s" may be a value; the stock one
        # only accepts plain numbers.
        self._negative_number_matcher = _NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see '{self.prog} --help')\n")
        sys.exit(2)


__all__ = ["CommandParser"]
