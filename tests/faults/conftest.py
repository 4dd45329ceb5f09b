"""The fault suite (``make faults``): real processes, real faults, a printed tally.

Every test module here sets ``pytestmark = pytest.mark.faults``, so it is left out of ``make test``. Each one
records what a user would look at (lost, early, duplicated, worst lateness,
longest stall) in the ``fault_report`` fixture; the table is printed at the end
of the run, so ``make faults`` shows figures as well as pass/fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


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
