"""``delaymq cluster --replicas 1``: the realtime group gets a sync slave, and ``delaymq status`` shows it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..support.cli import delaymq, wait_for_status

pytestmark = pytest.mark.slow

GROUP = "realtime-1"


def test_a_cluster_with_one_replica_shows_a_realtime_master_and_its_in_sync_slave(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "warning", "cluster", "--data", str(tmp_path),
         "--meta-listen", "127.0.0.1:0", "--replicas", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        members: list[str] = []
        meta = ""
        for line in process.stdout:
            if match := re.match(r"metaserver\s+(\S+)", line):
                meta = match[1]
            if match := re.match(r"realtime\s+(\S+)\s+\(group (\S+?)[,)]", line):
                assert match[2] == GROUP
                members.append(match[1])
            if line.startswith("Ctrl-C"):
                break
        assert meta and len(members) == 2, members
        master, slave = members
        assert (tmp_path / f"{GROUP}-replica-1").is_dir()

        def in_sync(answer: dict[str, Any]) -> bool:
            rows = {row["address"]: row for row in answer["rows"] if row["group"] == GROUP}
            statistics = answer["realtime"].get(f"{GROUP} {master}", {}).get("statistics", {})
            replication = statistics.get("replication", {})
            replicas = replication.get("replicas", [])
            recorded = replication.get("in_sync_recorded") == [slave]  # the master heard the metaserver's record
            return bool(replicas) and replicas[0]["in_sync"] and rows.get(slave, {}).get("in_sync") is True and recorded

        answer = wait_for_status(meta, in_sync)
        rows = {row["address"]: row for row in answer["rows"] if row["group"] == GROUP}
        assert rows[master]["role"] == "master" and rows[slave]["role"] == "slave"
        epoch = rows[master]["epoch"]
        assert epoch == rows[slave]["epoch"] > 0
        shown = {address: answer["realtime"][f"{GROUP} {address}"]["statistics"] for address in members}
        assert (shown[master]["role"], shown[master]["epoch"]) == ("master", epoch)
        assert (shown[slave]["role"], shown[slave]["epoch"], shown[slave]["master"]) == ("slave", epoch, master)
        assert shown[master]["replication"]["mode"] == "sync" and shown[master]["replication"]["min_insync"] == 0

        # A message sent now is answered once the slave holds it: the slave's log ends where the master's does.
        sent = delaymq("send", "--meta", meta, "demo", "hello")
        assert sent.returncode == 0, sent.stderr
        answer = wait_for_status(
            meta,
            lambda a: (
                a["realtime"][f"{GROUP} {slave}"]["statistics"]["replication"]["durable_end"]
                == a["realtime"][f"{GROUP} {master}"]["statistics"]["replication"]["durable_end"]
                > shown[master]["replication"]["durable_end"]
            ),
        )
        table = delaymq("status", "--meta", meta).stdout
        assert f"realtime {GROUP} at {master}: master (epoch {epoch}), " in table
        assert f"realtime {GROUP} at {slave}: slave (epoch {epoch}) of {master}, " in table
        assert f"  slave {slave}: in sync, lag 0 bytes" in table
        assert "  behind the master by 0 bytes" in table
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
