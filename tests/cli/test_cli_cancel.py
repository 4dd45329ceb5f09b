"""``delaymq send --key``, ``cancel``, ``move`` and ``query`` against in-process servers on loopback,
and the README's "Cancel, move, query" examples run as written.

The commands run through ``main()`` in a worker thread while trio serves; the README's
blocks run in bash / Python child processes with the installed ``delaymq`` first on the PATH.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from delaymq.cli.main import main
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import open_scheduler

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_META = "127.0.0.1:20880"
LINE = re.compile(r"^(?P<id>\S+) (?P<state>\w+)(?P<rest>( \w+=\S+)*)$")


@asynccontextmanager
async def open_cluster(tmp_path: Path) -> AsyncIterator[str]:
    """A metaserver, a realtime server and a scheduler on loopback; yields the metaserver's address."""
    clock = SystemClock()
    async with (
        open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta,
        open_realtime_server(
            data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=meta.address, flush="async"
        ),
        open_scheduler(data_dir=tmp_path / "scheduler", clock=clock, meta_address=meta.address, flush="async"),
    ):
        yield meta.address


async def run_cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


def parse(out: str) -> list[dict[str, str]]:
    """Each output line as {"id", "state", and every name=value}."""
    rows = []
    for line in out.splitlines():
        match = LINE.match(line)
        assert match, line
        rows.append({"id": match["id"], "state": match["state"], **dict(p.split("=", 1) for p in line.split()[2:])})
    return rows


async def test_send_with_a_key_then_query_move_and_cancel_by_id_and_by_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with open_cluster(tmp_path) as meta:
        with trio.fail_after(60):
            assert (
                await run_cli(
                    "send", "--meta", meta, "reminders", "hi", "--delay", "1h", "--key", "b-9", "--count", "3"
                )
                == 0
            )
            ids = capsys.readouterr().out.split()
            assert len(ids) == 3

            assert await run_cli("query", "--meta", meta, *ids) == 0
            rows = parse(capsys.readouterr().out)
            assert [(r["id"], r["state"], r["group"]) for r in rows] == [(i, "scheduled", "scheduler-1") for i in ids]
            assert all(r["deliver_at"].endswith("Z") and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d", r["hour"]) for r in rows)

            assert await run_cli("move", "--meta", meta, ids[0], "--at", "2027-06-01T12:00:00Z") == 0
            [moved] = parse(capsys.readouterr().out)
            assert (moved["id"], moved["state"], moved["deliver_at"]) == (ids[0], "moved", "2027-06-01T12:00:00.000Z")

            assert await run_cli("cancel", "--meta", meta, ids[1], "no-such-id") == 0
            assert [(r["id"], r["state"]) for r in parse(capsys.readouterr().out)] == [
                (ids[1], "cancelled"), ("no-such-id", "unknown"),
            ]  # fmt: skip

            assert await run_cli("cancel", "--meta", meta, "--subject", "reminders", "--key", "b-9", "--json") == 0
            answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            assert sorted((a["id"], a["state"]) for a in answers) == sorted((i, "cancelled") for i in ids)

            assert await run_cli("query", "--meta", meta, "--json", *ids) == 0
            assert [json.loads(line)["state"] for line in capsys.readouterr().out.splitlines()] == ["cancelled"] * 3


async def test_what_names_no_message_is_refused_with_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with open_cluster(tmp_path) as meta:
        with trio.fail_after(60):
            assert await run_cli("cancel", "--meta", meta) == 1
            assert "ids" in capsys.readouterr().err
            assert await run_cli("cancel", "--meta", meta, "--key", "b-9") == 1
            assert "subject" in capsys.readouterr().err
            assert await run_cli("send", "--meta", meta, "s", "x", "--delay", "1h", "--key", "k" * 257) == 1
            assert "key is 257 UTF-8 bytes, must be 1 to 256" in capsys.readouterr().err
            with pytest.raises(SystemExit) as caught:
                await run_cli("move", "--meta", meta, "some-id")  # no new time
            assert caught.value.code == 2


def readme_section() -> list[tuple[str, str]]:
    """(language, code) of each block of the README's "Cancel, move, query" section."""
    text = README.read_text()
    section = text.split("## Cancel, move, query\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(bash|py)\n(.*?)^```", section, re.MULTILINE | re.DOTALL)


async def test_the_readme_cancel_move_query_examples_run_as_written(tmp_path: Path) -> None:
    blocks = readme_section()
    assert [language for language, _ in blocks] == ["bash", "py"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    async with open_cluster(tmp_path) as meta:
        outputs = []
        for language, code in blocks:
            code = code.replace(DEFAULT_META, meta)
            command = (
                ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-P", "-c", code]
            )
            with trio.fail_after(120):
                done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, env=env, check=False)
            assert done.returncode == 0, f"README {language} block failed:\n{code}\n{done.stderr.decode()}"
            outputs.append(done.stdout.decode())
    shell, program = outputs
    query, move, cancel, last = shell.splitlines()
    message_id = query.split()[0]
    assert parse(query)[0]["state"] == "scheduled" and parse(query)[0]["group"] == "scheduler-1"
    assert parse(move)[0]["id"] == message_id and parse(move)[0]["state"] == "moved"
    assert (parse(cancel)[0]["id"], parse(cancel)[0]["state"]) == (message_id, "cancelled")
    assert json.loads(last)["state"] == "cancelled"
    assert program == "scheduled\nTrue cancelled\n"


@pytest.mark.slow
def test_the_cancel_bench_prints_rates_and_the_index_size(tmp_path: Path) -> None:
    """``delaymq bench cancel``, tiny: real server processes, every figure present and sane."""
    from delaymq.bench.cancel import bench_cancel

    rows = bench_cancel(tmp_path, counts=[4_000], operations=400)
    figures = {name: (value, unit) for name, value, unit in rows}
    rates = {name: value for name, (value, unit) in figures.items() if unit in ("ids/s", "keys/s")}
    assert len(rates) == 5 and all(rate > 0 for rate in rates.values()), rows
    assert any("CANCEL by key" in name for name in rates)
    entries = [unit for name, (value, unit) in figures.items() if "lmdb db" in name and value > 0]
    assert any("4,000 entries" in unit for unit in entries), rows  # the id index holds every message
    assert any("VmRSS" in name and value > 0 for name, (value, _) in figures.items()), rows
