"""The packaging check (docs/architecture.md, "Layers").

Build the wheel, install it into a fresh virtual environment, and from a folder
outside the repository import every module the source tree holds and run
``delaymq --help``. A subpackage missing from pyproject's hand-written
``packages`` list fails here; so does anything that shadows PyPI's ``wheel``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What the ``spark`` extra brings: the backlog job's own dependencies.
SPARK_EXTRA = {"pyspark", "plotly", "pyarrow"}
CODE_FOLDERS = [
    "protocol",
    "clock",
    "net",
    "storage",
    "wheel",
    "replication",
    "scheduler",
    "realtime",
    "metaserver",
    "client",
    "cli",
    "backlog",
    "bench",
]


def source_modules() -> list[str]:
    """Every module the repository's code folders hold, as installed names."""
    names = []
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue  # running it is the point, importing it would run the CLI
            if parts[-1] == "__init__":
                parts.pop()
            names.append("delaymq." + ".".join(parts))
    return names


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_built_wheel_installs_and_imports_everywhere(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], tmp_path)
    (wheel_file,) = dist.glob("delaymq-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", str(wheel_file), "wheel"], tmp_path)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    modules = source_modules()
    # Installed without extras: only the backlog job may need the spark extra's packages.
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        "    except ModuleNotFoundError as error:\n"
        f"        if name.startswith('delaymq.backlog.') and error.name.split('.')[0] in {sorted(SPARK_EXTRA)!r}:\n"
        "            continue\n"
        "        raise\n"
        f"    assert {str(ROOT)!r} not in (module.__file__ or ''), name + ' imported from the source tree'\n"
        "import wheel, wheel.wheelfile\n"  # PyPI's wheel still importable, not shadowed
        "assert 'site-packages' in wheel.__file__, wheel.__file__\n"
        "print(len(sys.argv), 'ok')\n"
    )
    run([str(python), "-P", "-c", script], outside)
    help_text = run([str(env_dir / "bin" / "delaymq"), "--help"], outside).stdout
    assert "usage: delaymq" in help_text
    backlog = subprocess.run(
        [str(env_dir / "bin" / "delaymq"), "backlog", "--scheduler-data", str(outside), "--out", str(outside / "out")],
        cwd=outside, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert backlog.returncode == 2 and "pip install 'delaymq[spark]'" in backlog.stderr, backlog.stderr
    version = run([str(env_dir / "bin" / "delaymq"), "--version"], outside).stdout
    assert version.startswith("delaymq ")
