"""The fault suite (``make faults``): real processes, real faults, a printed tally.

Every test module here sets ``pytestmark = pytest.mark.faults``, so it is left out of ``make test``. Each one
records what a user would look at (lost, early, duplicated, worst lateness,
longest stall) in the ``fault_report`` fixture; the table is printed at the end
of the run, so ``make faults`` shows figures as well as pass/fail.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from delaymq.bench.failover import ServerChild


@dataclass
class FaultRow:
    test: str
    figures: dict[str, float | int | str] = field(default_factory=dict)


_ROWS: list[FaultRow] = []


class FaultReport:
    """One test's figures; ``record(lost=0, early=0, ...)`` adds to them."""

    def __init__(self, row: FaultRow) -> None:
        self._row = row

    def record(self, **figures: float | int | str) -> None:
        self._row.figures.update(figures)


@pytest.fixture
def fault_report(request: pytest.FixtureRequest) -> Iterator[FaultReport]:
    row = FaultRow(request.node.name)
    _ROWS.append(row)
    yield FaultReport(row)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _ROWS:
        return
    terminalreporter.section("fault suite figures")
    for row in _ROWS:
        figures = "  ".join(f"{key}={value}" for key, value in row.figures.items())
        terminalreporter.write_line(f"{row.test}: {figures or '(no figures recorded)'}")


# ------------------------------------------------------------------ server processes' logs


class ServerCrashed(AssertionError):
    """A server process logged a traceback: it died of an error, not of the test's signals."""


def check_crashes(root: Path, error: BaseException | None) -> None:
    """Raise ``ServerCrashed`` (chained to ``error``) when a ``*.log`` under ``root`` holds a traceback."""
    crashed = {}
    for log in sorted(root.glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            crashed[log.name] = text[text.index("Traceback") :][-1500:]
    if crashed:
        report = "\n".join(f"{name}: ...{text}" for name, text in crashed.items())
        raise ServerCrashed(report) from error


@contextmanager
def _crash_watch(root: Path) -> Iterator[None]:
    try:
        yield
    except BaseException as error:
        check_crashes(root, error)
        raise
    check_crashes(root, None)


@pytest.fixture
def servers_must_not_crash() -> Callable[[Path], AbstractContextManager[None]]:
    """``with servers_must_not_crash(root):`` fails with ``ServerCrashed`` (whatever else failed) when
    a server's log under ``root`` holds a traceback: the crash is the cause a user would look for first."""
    return _crash_watch


def _cut_in_log(child: ServerChild, start: int, *, unit: str = "record") -> int:
    """What a member logged as cut since the ``start``-th start of its process: records
    (``cut N record(s)``), or with ``unit="message"`` the messages among them (a realtime
    member's ``cut N record(s) (M message(s), ...``)."""
    pattern = r"cut (\d+) record\(s\)" if unit == "record" else r"cut \d+ record\(s\) \((\d+) message\(s\)"
    runs = child.log_text().split("---- start ")
    return sum(int(n) for run in runs[start:] for n in re.findall(pattern, run))


@pytest.fixture
def cut_in_log() -> Callable[..., int]:
    """``cut_in_log(child, start, unit="record"|"message")``: what a member's log says it cut."""
    return _cut_in_log
