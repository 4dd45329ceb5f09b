"""``delaymq cluster --replicas N``: the local cluster's scheduler group gets N slaves."""

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


def test_a_cluster_with_one_replica_shows_a_master_and_an_in_sync_slave(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "warning", "cluster", "--data", str(tmp_path),
         "--meta-listen", "127.0.0.1:0", "--replicas", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        schedulers: list[str] = []
        meta = ""
        for line in process.stdout:
            if match := re.match(r"metaserver\s+(\S+)", line):
                meta = match[1]
            if match := re.match(r"scheduler\s+(\S+)", line):
                schedulers.append(match[1])
            if line.startswith("Ctrl-C"):
                break
        assert meta and len(schedulers) == 2

        def in_sync(answer: dict[str, Any]) -> bool:
            members = {row["address"]: row for row in answer["rows"] if row["kind"] == "scheduler"}
            master = answer["schedulers"].get(f"scheduler-1 {schedulers[0]}", {})
            replicas = master.get("statistics", {}).get("replication", {}).get("replicas", [])
            return bool(replicas and replicas[0]["in_sync"] and members[schedulers[1]].get("in_sync"))

        # the slave catches up and the master reports it in sync (about a second)
        answer = wait_for_status(meta, in_sync)
        members = {row["address"]: row for row in answer["rows"] if row["kind"] == "scheduler"}
        assert members[schedulers[0]]["role"] == "master" and members[schedulers[1]]["role"] == "slave"
        assert members[schedulers[0]]["epoch"] == members[schedulers[1]]["epoch"] > 0
        table = delaymq("status", "--meta", meta).stdout
        assert f"slave {schedulers[1]}: in sync" in table
        assert f"scheduler scheduler-1 at {schedulers[1]}: slave (epoch " in table
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
