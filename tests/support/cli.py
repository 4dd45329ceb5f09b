"""The ``delaymq`` command run as a user would, in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .polling import poll_until


def delaymq(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -P -m delaymq.cli ARGS``, its output captured (bounded: 60 s)."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "delaymq.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def status(meta: str) -> dict[str, Any]:
    """``delaymq status --json --meta META``."""
    answer: dict[str, Any] = json.loads(delaymq("status", "--json", "--meta", meta).stdout)
    return answer


def wait_for_status(meta: str, ready: Callable[[dict[str, Any]], object], *, timeout: float = 30.0) -> dict[str, Any]:
    """``delaymq status --json`` every 0.2 s until ``ready(answer)`` holds (a bounded poll of what a user would
    run); the answer."""
    return poll_until(lambda: status(meta), ready, timeout=timeout, interval=0.2, what="the status asked for")
