"""The same job through ``spark-submit``: deploy/spark/submit.sh builds the wheel and ships it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_submit_script_runs_the_job_on_spark_submit(cluster_data: Any, tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "spark-submit").exists():
        pytest.skip("pyspark's spark-submit is not beside this Python")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    out = tmp_path / "out"
    done = subprocess.run(
        [str(REPO / "deploy" / "spark" / "submit.sh"), "--master", "local[2]", "--",
         "--scheduler-data", f"file://{cluster_data.root / 'scheduler-1'}",
         "--realtime-data", f"file://{cluster_data.root / 'realtime-1'}",
         "--out", f"file://{out}", "--at", "2100-01-01T00:00:00Z"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"scheduled: {len(cluster_data.far) + 1:,} messages to deliver" in done.stdout
    assert (out / "report.html").exists() and (out / "scheduled_backlog").is_dir()
