"""Every code example in the README runs as written against a live ``delaymq cluster``.

The examples name the default metaserver address; the test's cluster listens on a
free port, so that address is the one thing replaced. Shell blocks run in bash
with the installed ``delaymq`` first on the PATH, Python blocks as scripts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from delaymq.bench.cluster import local_cluster

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_META = "127.0.0.1:20880"
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every ``sh`` and ``python`` block but the quick start (``make``)."""
    blocks = BLOCK.findall(README.read_text())
    return [(language, code) for language, code in blocks if not code.lstrip().startswith("make ")]


@pytest.fixture(scope="module")
def meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with local_cluster(tmp_path_factory.mktemp("readme"), flush="sync") as cluster:
        yield cluster.meta


def run_block(language: str, code: str, meta: str, cwd: Path) -> str:
    code = code.replace(DEFAULT_META, meta)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    command = ["bash", "-euo", "pipefail", "-c", code] if language == "sh" else [sys.executable, "-P", "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert done.returncode == 0, f"README {language} block failed ({done.returncode}):\n{code}\n{done.stderr}"
    return done.stdout


def test_the_readme_has_the_examples_this_test_checks() -> None:
    blocks = readme_blocks()
    assert [language for language, _ in blocks] == ["sh", "sh", "python", "python"]


def test_every_readme_example_runs_as_written(meta: str, tmp_path: Path) -> None:
    shell, delayed, trio_program, blocking_program = (code for _, code in readme_blocks())

    lines = run_block("sh", shell, meta, tmp_path).splitlines()
    ids, printed = lines[:4], [json.loads(line) for line in lines[4:]]
    assert all(re.fullmatch(r"[0-9A-Za-z_-]+", message_id) for message_id in ids), lines
    assert [message["id"] for message in printed] == ids[:3]  # --max 3: the three tagged ones, in order
    assert {message["body"] for message in printed} == {"hello"}

    out = run_block("sh", delayed, meta, tmp_path)
    assert len(out.split("\n", 2)[0]) > 0  # the scheduled message's id
    assert "scheduler" in out  # status lists the scheduler group

    out = run_block("python", trio_program, meta, tmp_path)
    assert re.search(r"^sent \S+ and 100 more$", out, re.MULTILINE), out
    assert re.search(r"^received \S+ b'\{\"id\": 7\}'$", out, re.MULTILINE), out

    assert run_block("python", blocking_program, meta, tmp_path) == "b'hi'\n"
