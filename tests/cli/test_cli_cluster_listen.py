"""``delaymq cluster`` keeps its servers' addresses across restarts (DATA/cluster-listen.json)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from delaymq.cli.cluster_command import LISTEN_FILE, choose_listen, read_listen_file


def test_an_asked_port_wins_else_the_remembered_one_on_the_same_host() -> None:
    assert choose_listen("127.0.0.1:7000", "127.0.0.1:41000") == ("127.0.0.1:7000", False)
    assert choose_listen("127.0.0.1:0", "127.0.0.1:41000") == ("127.0.0.1:41000", True)
    assert choose_listen(None, "127.0.0.1:41000") == ("127.0.0.1:41000", True)
    assert choose_listen(None, None) == ("127.0.0.1:0", False)
    assert choose_listen("[::1]:0", "127.0.0.1:41000") == ("[::1]:0", False)  # another host: a new port
    assert choose_listen("[::1]:0", "[::1]:41000") == ("[::1]:41000", True)


def test_an_unreadable_listen_file_means_choosing_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert read_listen_file(tmp_path) == {}
    (tmp_path / LISTEN_FILE).write_text("{not json")
    assert read_listen_file(tmp_path) == {}
    assert "choosing the servers' ports again" in caplog.text
    (tmp_path / LISTEN_FILE).write_text(json.dumps({"format": 1, "realtime": "127.0.0.1:5", "scheduler": 7}))
    assert read_listen_file(tmp_path) == {"realtime": "127.0.0.1:5"}


def start_cluster(data: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "warning", "cluster", "--data", str(data),
         "--meta-listen", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    addresses: dict[str, str] = {}
    for line in process.stdout:
        match = re.match(r"(metaserver|realtime|scheduler)\s+(\S+)", line)
        if match:
            addresses[match[1]] = match[2]
        if line.startswith("Ctrl-C"):
            return process, addresses
    raise AssertionError(f"the cluster did not start: {process.wait()} {process.stderr.read()}")  # type: ignore[union-attr]


def kill(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.stderr is not None
    return process.stderr.read()


def test_a_sigkilled_cluster_comes_back_on_the_same_ports(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    first, addresses = start_cluster(data)
    kill(first)
    assert json.loads((data / LISTEN_FILE).read_text()) == {"format": 1, **addresses}
    again, restarted = start_cluster(data)
    try:
        assert restarted == addresses
    finally:
        kill(again)


def test_a_remembered_port_taken_since_gives_way_to_a_free_one(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    first, addresses = start_cluster(data)
    kill(first)
    host, port = addresses["realtime"].rsplit(":", 1)
    with socket.socket() as squatter:
        # The cluster's children die with it (a death signal), a moment after it: wait for the port.
        deadline = time.monotonic() + 15
        while True:
            try:
                squatter.bind((host, int(port)))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        squatter.listen()
        again, restarted = start_cluster(data)
        errors = kill(again)
    assert restarted["realtime"] != addresses["realtime"]
    assert restarted["metaserver"] == addresses["metaserver"] and restarted["scheduler"] == addresses["scheduler"]
    assert f"the realtime server's remembered address {addresses['realtime']} is taken" in errors
    assert json.loads((data / LISTEN_FILE).read_text())["realtime"] == restarted["realtime"]
