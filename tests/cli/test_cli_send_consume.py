"""``delaymq send`` and ``delaymq consume`` against an in-process metaserver and realtime server.

The commands run through ``main()`` in a worker thread while trio serves.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from delaymq.cli.consume_command import as_text
from delaymq.cli.main import main
from delaymq.cli.send_command import when
from delaymq.client.delivery import ReceivedMessage
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.realtime.server import open_realtime_server


@asynccontextmanager
async def open_cluster(tmp_path: Path) -> AsyncIterator[str]:
    clock = SystemClock()
    async with open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta:
        async with open_realtime_server(
            data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=meta.address, flush="async"
        ):
            yield meta.address


async def run_cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


async def test_send_then_consume_json_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_cluster(tmp_path) as meta:
        with trio.fail_after(30):
            code = await run_cli("send", "--meta", meta, "orders", "hello", "--tag", "a", "--tag", "b", "--count", "3")
            assert code == 0
            ids = capsys.readouterr().out.split()
            assert len(ids) == 3 and len(set(ids)) == 3
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\x00 binary")))
            assert await run_cli("send", "--meta", meta, "orders", "-") == 0
            binary_id = capsys.readouterr().out.strip()

            code = await run_cli(
                "consume", "--meta", meta, "orders", "--group", "cli", "--from", "earliest",
                "--max", "4", "--timeout", "10s", "--json",
            )  # fmt: skip
            assert code == 0
            lines = capsys.readouterr().out.splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["id"] for r in records] == [*ids, binary_id]
        for record in records[:3]:
            assert (record["subject"], record["tags"], record["body"]) == ("orders", ["a", "b"], "hello")
            assert record["received_at"] >= record["deliver_at"] > 1_600_000_000_000
        assert records[3]["body_base64"] == "/wAgYmluYXJ5" and "body" not in records[3]

        # Everything was acked: the group has nothing left, so --timeout ends the run.
        with trio.fail_after(30):
            assert await run_cli("consume", "--meta", meta, "orders", "--group", "cli", "--timeout", "300ms") == 0
        assert capsys.readouterr().out == ""


async def test_consume_prints_readable_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with open_cluster(tmp_path) as meta:
        with trio.fail_after(30):
            assert await run_cli("send", "--meta", meta, "news", "good news") == 0
            message_id = capsys.readouterr().out.strip()
            code = await run_cli("consume", "--meta", meta, "news", "--group", "g", "--from", "earliest", "--max", "1")
            assert code == 0
        line = capsys.readouterr().out.strip()
        assert message_id in line and "'good news'" in line and line.startswith("20")


async def test_errors_print_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with open_cluster(tmp_path) as meta:
        with trio.fail_after(30):
            assert await run_cli("send", "--meta", meta, "s" * 300, "x") == 1
            err = capsys.readouterr().err.strip().splitlines()
            assert err == ["delaymq send: subject is 300 UTF-8 bytes, must be 1 to 255"]
            assert await run_cli("send", "--meta", meta, "orders", "x", "--delay", "90s") == 1
            assert "no scheduler group" in capsys.readouterr().err  # no scheduler runs here
            assert await run_cli("send", "--meta", meta, "orders", "x", "--at", "2099-01-01T00:00:00Z") == 1
            assert "horizon" in capsys.readouterr().err
    with trio.fail_after(30):
        assert await run_cli("consume", "--meta", "127.0.0.1:1", "orders", "--group", "g", "--timeout", "1s") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("delaymq consume: ") and "127.0.0.1:1" in err[0]


async def test_a_negative_delay_is_delivered_now(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with open_cluster(tmp_path) as meta:  # no scheduler runs: a past moment goes straight to realtime
        with trio.fail_after(30):
            assert await run_cli("send", "--meta", meta, "orders", "late", "--delay", "-5s") == 0
            message_id = capsys.readouterr().out.strip()
            code = await run_cli(
                "consume", "--meta", meta, "orders", "--group", "g", "--from", "earliest", "--max", "1", "--json"
            )
            assert code == 0
        record = json.loads(capsys.readouterr().out)
        assert record["id"] == message_id and record["body"] == "late"
        assert record["received_at"] - record["deliver_at"] >= 5_000  # it was due five seconds before it was sent


async def test_consume_max_pulls_no_more_than_it_prints_so_the_next_consume_gets_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = SystemClock()
    async with open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta:
        async with open_realtime_server(
            data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=meta.address, flush="async"
        ) as server:
            with trio.fail_after(30):  # half the server's 60 s ack timeout: nothing waits for it
                assert await run_cli("send", "--meta", meta.address, "orders", "x", "--count", "300") == 0
                sent = capsys.readouterr().out.split()
                consume = ("consume", "--meta", meta.address, "orders", "--group", "g", "--json")
                assert await run_cli(*consume, "--from", "earliest", "--max", "120") == 0
                first = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
                assert len(first) == 120 and server.statistics().messages_delivered == 120
                assert await run_cli(*consume, "--max", "180", "--timeout", "10s") == 0
                second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            stats = server.statistics()
            assert (stats.messages_delivered, stats.redeliveries) == (300, 0)
        assert [r["id"] for r in first + second] == sent
        assert {r["attempts"] for r in second} == {0}


def test_at_needs_a_timezone() -> None:
    assert when("2026-12-24T18:00:00Z").isoformat() == "2026-12-24T18:00:00+00:00"  # type: ignore[union-attr]
    assert when("1798135200000") == 1798135200000
    with pytest.raises(Exception, match="no timezone"):
        when("2026-12-24T18:00:00")


def test_text_lines_show_binary_bodies_by_size() -> None:
    message = ReceivedMessage("id1", "s", ("t",), {}, b"\xff\xfe", 0, 0, 1, 5, "rt1", 0)
    assert as_text(message) == "1970-01-01T00:00:00.000Z (+5 ms) s id1 [t] attempt 2: <2 bytes>"
