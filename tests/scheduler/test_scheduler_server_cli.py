"""The scheduler from the command line's side: ``delaymq status`` shows each scheduler's
tick and pending hours; ``delaymq scheduler`` checks its options.

Real servers on loopback with the real clock (the status command is blocking code, run
in a thread); every wait ends on an observable condition, bounded by ``fail_after``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import trio

from delaymq.cli.main import main
from delaymq.client import open_consumer, open_producer
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import open_scheduler


async def test_status_shows_each_scheduler_tick_and_pending_hours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = SystemClock()
    async with (
        open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta,
        open_realtime_server(data_dir=tmp_path / "rt", clock=clock, meta_address=meta.address, flush="async"),
        open_scheduler(data_dir=tmp_path / "sched", clock=clock, meta_address=meta.address) as scheduler,
    ):
        with trio.fail_after(20):
            async with open_producer(meta.address) as producer:
                soon = await producer.send("orders", "soon", delay=0.2)
                await producer.send_batch([producer.message("orders", f"later {n}", delay=86_400) for n in range(3)])
            async with open_consumer(meta.address, "orders", group="g", start="earliest") as consumer:
                message = await consumer.receive()
                await message.ack()
            assert message.id == soon and message.received_at >= message.deliver_at
            code = await trio.to_thread.run_sync(main, ["status", "--meta", meta.address])
            table = capsys.readouterr().out
            code_json = await trio.to_thread.run_sync(
                main, ["status", "--json", "--meta", meta.address, "--hours", "5"]
            )
            answer = json.loads(capsys.readouterr().out)
    assert code == code_json == 0
    assert re.search(
        rf"scheduler scheduler-1 at {re.escape(scheduler.address)}: master \(epoch [1-9][0-9]*\), tick ", table
    )
    assert "3 pending, 1 dispatched" in table
    tomorrow = answer["schedulers"][f"scheduler-1 {scheduler.address}"]
    assert [hour["pending"] for hour in tomorrow["hours"]] == [3]
    assert table.rstrip().endswith(f"{tomorrow['hours'][0]['name']}        3")


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["scheduler"], "--data DIR is required"),
        (["scheduler", "--data", "d", "--horizon", "0s"], "--horizon: Limits.horizon_ms must be an int from 1"),
    ],
)
def test_scheduler_command_refuses_bad_options(
    argv: list[str], complaint: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert main(argv) == 2
    assert complaint in caplog.text


def test_scheduler_command_refuses_a_bad_duration(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["scheduler", "--data", "d", "--retention", "3x"])
    assert "argument --retention: '3x' is not a duration" in capsys.readouterr().err
