"""``--metrics-listen`` from a config file, on the real commands: each server process serves
its metrics, off unless asked for, and stops cleanly on SIGTERM with the endpoint open."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from delaymq.cli.main import parse_args
from delaymq.client import open_producer

from .test_metrics_cluster import scrape, scrape_until, value

_METRICS_LINE = re.compile(rb"metrics on http://(?P<address>\S+)/metrics")
_LISTENING = re.compile(rb"listening on (?P<address>\S+)")


@asynccontextmanager
async def server_process(config: Path, command: str) -> AsyncIterator[tuple[str, str, trio.Process]]:
    """``delaymq --config CONFIG COMMAND``; yields its address, its metrics address and the process."""
    argv = [sys.executable, "-P", "-m", "delaymq.cli", "--config", str(config), command]
    process = await trio.lowlevel.open_process(argv, stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        seen = b""
        with trio.fail_after(30):
            while not (_METRICS_LINE.search(seen) and _LISTENING.search(seen)):
                chunk = await process.stderr.receive_some(4096)
                assert chunk, f"{command} exited with {await process.wait()}: {seen.decode(errors='replace')}"
                seen += chunk
        listening, metrics = _LISTENING.search(seen), _METRICS_LINE.search(seen)
        assert listening is not None and metrics is not None
        yield listening["address"].decode(), metrics["address"].decode(), process
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            while await process.stderr.receive_some(65536):  # drain, so the server never blocks on a full pipe
                pass
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_metaserver_and_realtime_commands_serve_metrics_from_their_config(tmp_path: Path) -> None:
    meta_config = tmp_path / "metaserver.toml"
    meta_config.write_text(
        f'[metaserver]\nlisten = "127.0.0.1:0"\ndata = "{tmp_path / "meta"}"\nmetrics-listen = "127.0.0.1:0"\n'
    )
    async with server_process(meta_config, "metaserver") as (meta, meta_metrics, _):
        samples, _ = await scrape(meta_metrics)
        assert value(samples, "delaymq_metaserver_servers") == 0
        rt_config = tmp_path / "realtime.toml"
        rt_config.write_text(
            f'[realtime]\nlisten = "127.0.0.1:0"\nmeta = ["{meta}"]\ndata = "{tmp_path / "rt"}"\n'
            'group = "realtime-7"\nmetrics-listen = "127.0.0.1:0"\n'  # the command's replication defaults
        )
        async with server_process(rt_config, "realtime") as (rt, rt_metrics, _):
            await scrape_until(meta_metrics, "delaymq_metaserver_servers", 1)
            samples = await scrape_until(rt_metrics, "delaymq_server_is_master", 1)
            info = [dict(labels) for name, labels in samples if name == "delaymq_server_info"]
            assert info[0]["group"] == "realtime-7" and info[0]["address"] == rt and info[0]["kind"] == "realtime"
            assert value(samples, "delaymq_realtime_messages_stored_total") == 0
            # A member alone serves with the defaults (sync replication, min-insync 0): stored at once.
            async with open_producer(meta) as producer:
                with trio.fail_after(10):
                    await producer.send("orders", "alone")
            await scrape_until(rt_metrics, "delaymq_realtime_messages_stored_total", 1)


def test_metrics_are_off_unless_asked_for() -> None:
    for command in ("metaserver", "realtime", "scheduler"):
        assert parse_args([command, "--data", "d"]).metrics_listen is None
        assert parse_args([command, "--metrics-listen", "127.0.0.1:9100"]).metrics_listen == "127.0.0.1:9100"
