"""deploy/compose/smoke.sh end to end: image from the wheel, the compose cluster, messages, metrics.

Needs a Docker engine and compose (the ``docker compose`` plugin or ``docker-compose``
1.29); skipped without them, so it runs under ``make faults`` on a machine that has them
and never in ``make test``. The image's base is ``$BASE_IMAGE`` when set, else
python:3.11-slim when the engine holds it, else a local ``delaymq-base:bookworm`` (made
with debootstrap where Docker Hub is out of reach: docs/operations.md), else
python:3.11-slim pulled by the build.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.faults

SMOKE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "smoke.sh"


def _succeeds(*argv: str) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _engine_with_compose() -> bool:
    if shutil.which("docker") is None or not _succeeds("docker", "info"):
        return False
    return _succeeds("docker", "compose", "version") or shutil.which("docker-compose") is not None


def _base_image() -> str:
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    for image in ("python:3.11-slim", "delaymq-base:bookworm"):
        if _succeeds("docker", "image", "inspect", image):
            return image
    return "python:3.11-slim"


def _open_file_limit() -> str:
    """The compose file's 65536, or this machine's lower hard limit (an engine refuses more than its own)."""
    if os.environ.get("DELAYMQ_NOFILE"):
        return os.environ["DELAYMQ_NOFILE"]
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return str(65536 if hard == resource.RLIM_INFINITY else min(65536, hard))


@pytest.mark.skipif(not _engine_with_compose(), reason="needs a Docker engine and docker compose / docker-compose")
def test_the_compose_cluster_delivers_every_message_and_shows_it_in_its_metrics(fault_report: Any) -> None:
    env = dict(os.environ, BASE_IMAGE=_base_image(), DELAYMQ_NOFILE=_open_file_limit(), KEEP="0")
    started = time.monotonic()
    run = subprocess.run(["bash", str(SMOKE)], capture_output=True, text=True, env=env, timeout=900)
    seconds = time.monotonic() - started
    lines = [line for line in run.stdout.splitlines() if line.startswith("smoke:")]
    assert run.returncode == 0, "\n".join(lines) + "\n" + run.stderr[-3000:]
    assert lines[-1] == "smoke: OK"
    (sent,) = [int(m[1]) for line in lines if (m := re.match(r"smoke: sent (\d+) messages", line))]
    (received,) = [int(m[1]) for line in lines if (m := re.match(r"smoke: received all (\d+), each once", line))]
    ((servers, stored, dispatched),) = [
        tuple(int(group) for group in m.groups())
        for line in lines
        if (m := re.match(r"smoke: metrics: (\d+) servers registered, (\d+) messages stored, (\d+) dispatched", line))
    ]
    assert sent >= 25 and received == sent
    assert servers == 4 and stored >= sent and dispatched >= 20
    assert any(line.endswith("scheduler-1 2 up, 1 master") for line in lines)  # a master and its slave
    fault_report.record(lost=sent - received, sent=sent, stored=stored, dispatched=dispatched, seconds=round(seconds))
