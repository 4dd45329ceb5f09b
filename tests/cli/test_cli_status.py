"""``delaymq metaserver``, ``delaymq status`` and ``delaymq admin set-state``.

The metaserver runs as a real ``delaymq metaserver`` process on port 0; its
address is read from its "listening on" log line.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from delaymq.cli import options
from delaymq.cli.main import main
from delaymq.client.blocking import BlockingPeers
from delaymq.protocol.commands import Command

STARTUP_TIMEOUT = 30.0


class MetaserverProcess:
    def __init__(self, data: Path, *extra: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "delaymq.cli",
                "metaserver",
                "--listen",
                "127.0.0.1:0",
                "--data",
                str(data),
                *extra,
            ],
            stderr=subprocess.PIPE,
            text=True,
            cwd=data.parent,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.address = self.wait_for(r"metaserver listening on (\S+)").group(1)

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first log line (from now on) matching ``pattern``; fails if the process ends first."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no log line matching {pattern!r} within {STARTUP_TIMEOUT} s: {self.log}")
            if line is None:
                pytest.fail(f"the metaserver exited ({self.process.wait()}) before logging {pattern!r}: {self.log}")
            self.log.append(line)
            if match := re.search(pattern, line):
                return match

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=STARTUP_TIMEOUT)


@pytest.fixture
def metaserver(tmp_path: Path) -> Iterator[MetaserverProcess]:
    process = MetaserverProcess(tmp_path / "meta")
    try:
        yield process
    finally:
        if process.process.poll() is None:
            assert process.stop() == 0
            process.wait_for(r"stopping on SIGTERM")


def register(address: str, group: str, server: str, *, kind: str = "realtime", role: str = "master") -> None:
    with BlockingPeers(request_timeout=10) as peers:
        info = {"group": group, "kind": kind, "role": role, "address": server, "version": "0.1.0"}
        peers.call(address, Command.REGISTER, info)


def status_json(address: str, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert main(["status", "--json", "--meta", address]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_json_shows_registered_groups(metaserver: MetaserverProcess, capsys: pytest.CaptureFixture[str]) -> None:
    register(metaserver.address, "rt1", "10.0.0.1:20881")
    register(metaserver.address, "rt1", "10.0.0.2:20881", role="slave")
    register(metaserver.address, "sched1", "10.0.0.3:20882", kind="scheduler")
    answer = status_json(metaserver.address, capsys)
    assert answer["metaserver"] == metaserver.address
    assert answer["evict_after_ms"] == 30_000 and answer["heartbeat_interval_ms"] == 5_000
    rows = [(r["group"], r["kind"], r["role"], r["address"], r["state"], r["evicted"]) for r in answer["rows"]]
    assert rows == [
        ("rt1", "realtime", "master", "10.0.0.1:20881", "RW", False),
        ("rt1", "realtime", "slave", "10.0.0.2:20881", "RW", False),
        ("sched1", "scheduler", "master", "10.0.0.3:20882", "RW", False),
    ]
    assert all(0 <= r["seconds_since_heartbeat"] < 30 for r in answer["rows"])
    metaserver.wait_for(r"server 10.0.0.3:20882 registered: master of scheduler group sched1")


def test_status_table_is_readable(metaserver: MetaserverProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--meta", metaserver.address]) == 0
    assert "no server has registered" in capsys.readouterr().out
    register(metaserver.address, "rt1", "10.0.0.1:20881")
    assert main(["status", "--meta", metaserver.address]) == 0
    header, columns, row, member = capsys.readouterr().out.splitlines()
    assert member.startswith("realtime rt1 at 10.0.0.1:20881: no status (")  # registered, not really there
    assert header.startswith(f"metaserver {metaserver.address}: 1 groups, 1 servers, route version ")
    assert columns.split() == [
        "GROUP",
        "KIND",
        "ROLE",
        "EPOCH",
        "ADDRESS",
        "STATE",
        "LAST",
        "HEARTBEAT",
        "EVICTED",
        "VERSION",
    ]
    assert row.split()[:6] == ["rt1", "realtime", "master", "-", "10.0.0.1:20881", "RW"]
    assert row.split()[-2:] == ["no", "0.1.0"]


def test_admin_set_state_changes_a_state_kept_across_restarts(
    tmp_path: Path, metaserver: MetaserverProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    register(metaserver.address, "rt1", "10.0.0.1:20881")
    assert main(["admin", "set-state", "rt1", "r", "--meta", metaserver.address]) == 0
    assert capsys.readouterr().out == "group rt1: RW -> R\n"
    assert [r["state"] for r in status_json(metaserver.address, capsys)["rows"]] == ["R"]
    metaserver.wait_for(r"group rt1 state changed RW -> R")
    assert main(["admin", "set-state", "rt1", "R", "--meta", metaserver.address]) == 0
    assert capsys.readouterr().out == "group rt1 was already R\n"

    assert metaserver.stop() == 0
    again = MetaserverProcess(tmp_path / "meta")
    try:
        assert [(r["group"], r["state"]) for r in status_json(again.address, capsys)["rows"]] == [("rt1", "R")]
    finally:
        assert again.stop() == 0


def test_admin_set_state_of_unknown_group_names_it(
    metaserver: MetaserverProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["admin", "set-state", "nope", "NRW", "--meta", metaserver.address]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"metaserver {metaserver.address} refused" in err and "unknown group 'nope'" in err


def test_unreachable_metaserver_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"127.0.0.1:{port}"
    assert main(["status", "--meta", address]) == 1
    assert main(["admin", "set-state", "rt1", "R", "--meta", address]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"delaymq status: cannot reach metaserver {address}: cannot connect")
    assert lines[1].startswith(f"delaymq admin set-state: cannot reach metaserver {address}")


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["metaserver", "--data", "d", "--evict-after", "30x"], "argument --evict-after: '30x' is not a duration"),
        (["metaserver", "--data", "d", "--heartbeat-interval=-1s"], "--heartbeat-interval: '-1s' is not a duration"),
        (["metaserver", "--data", "d", "--listen", "localhost"], "argument --listen: 'localhost' is not HOST:PORT"),
        (["metaserver", "--data", "d", "--listen", "h:70000"], "port '70000'; a port is a number from 0 to 65535"),
        (["status", "--meta", "h:0"], "argument --meta: 'h:0' has port '0'; a port is a number from 1 to 65535"),
        (["status", "--meta", "::1:5"], "an IPv6 host goes in brackets, e.g. [::1]:5"),
        (["admin", "set-state", "rt1", "RO"], "argument STATE: 'RO' is not a group state; use one of RW, R, NRW"),
    ],
)
def test_bad_options_are_refused_clearly(argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_data_folder_is_required(caplog: pytest.LogCaptureFixture) -> None:
    assert main(["metaserver"]) == 2
    assert "--data DIR is required" in caplog.text


def test_heartbeat_interval_must_be_below_eviction(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    argv = ["metaserver", "--data", str(tmp_path), "--evict-after", "10s", "--heartbeat-interval", "10s"]
    assert main(argv) == 2
    assert "--heartbeat-interval (10s) must be at least 1ms and shorter than --evict-after (10s)" in caplog.text
    assert not any(tmp_path.iterdir())  # refused before touching the data folder


def test_busy_data_folder_is_one_clear_error(metaserver: MetaserverProcess, caplog: pytest.LogCaptureFixture) -> None:
    data = metaserver.process.args[metaserver.process.args.index("--data") + 1]
    assert main(["metaserver", "--data", data, "--listen", "127.0.0.1:0"]) == 1
    assert "the folder is already open" in caplog.text


@pytest.mark.parametrize(
    "text, seconds",
    [("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5), ("1h", 3600.0), (" 2 s ", 2.0), ("0", 0.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert options.duration(text) == seconds


def test_duration_ms_takes_config_numbers_as_seconds() -> None:
    assert options.duration_ms(30) == 30_000
    assert options.duration_ms(0.25) == 250
    assert options.duration_ms("500ms") == 500
    assert options.show_duration(30_000) == "30s" and options.show_duration(1_500) == "1500ms"


def test_config_file_sets_metaserver_options(tmp_path: Path) -> None:
    from delaymq.cli.main import parse_args

    config = tmp_path / "delaymq.toml"
    config.write_text(
        '[metaserver]\nlisten = "0.0.0.0:9000"\ndata = "/srv/meta"\nevict-after = "1m"\nheartbeat-interval = 2\n'
    )
    args = parse_args(["--config", str(config), "metaserver"])
    assert (args.listen, args.data) == ("0.0.0.0:9000", Path("/srv/meta"))
    assert options.duration_ms(args.evict_after) == 60_000
    assert options.duration_ms(args.heartbeat_interval) == 2_000


# -- admin handover --------------------------------------------------------------------

MASTER, TARGET = "10.0.0.1:20882", "10.0.0.2:20882"


def beat_member(peers: BlockingPeers, meta: str, server: str, **replica: object) -> dict:
    """A scheduler of the replicated group sched1 registers (and so heartbeats) with its replica state."""
    info = {"group": "sched1", "kind": "scheduler", "role": "master", "address": server, "version": "0.1.0"}
    info.update(member=f"folder-{server}", incarnation="run1", replica={"offset": 10, "epoch": 0, **replica})
    return peers.call(meta, Command.REGISTER, info).metadata


def replicated_group(meta: str) -> int:
    """MASTER and TARGET, the master reporting TARGET in sync at the group's epoch; that epoch."""
    with BlockingPeers(request_timeout=10) as peers:
        first = beat_member(peers, meta, MASTER)
        assert first["role"] == "master"
        assert beat_member(peers, meta, TARGET)["role"] == "slave"
        assert beat_member(peers, meta, MASTER, epoch=first["epoch"], in_sync=[TARGET])["in_sync"] == [TARGET]
        return int(first["epoch"])


def test_admin_handover_waits_until_the_target_is_master(
    metaserver: MetaserverProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    epoch = replicated_group(metaserver.address)
    stop = threading.Event()

    def master_and_slave() -> None:
        """The master drains as soon as it is asked, and says so; both keep heartbeating."""
        handed_over: dict[str, int] = {}
        with BlockingPeers(request_timeout=10) as peers:
            while not stop.wait(0.05):
                answer = beat_member(peers, metaserver.address, MASTER, epoch=epoch, in_sync=[TARGET], **handed_over)
                if answer.get("handover_to") == TARGET:
                    handed_over = {"handed_over": answer["epoch"]}
                beat_member(peers, metaserver.address, TARGET)

    servers = threading.Thread(target=master_and_slave)
    servers.start()
    try:
        assert main(["admin", "handover", "sched1", "--to", TARGET, "--meta", metaserver.address]) == 0
    finally:
        stop.set()
        servers.join()
    asked, done = capsys.readouterr().out.splitlines()
    epoch = int(re.fullmatch(rf"group sched1: handover from {MASTER} to {TARGET} asked at epoch (\d+)", asked)[1])
    new = int(re.match(rf"group sched1: {TARGET} is master at epoch (\d+) \(", done)[1])
    assert new > epoch
    metaserver.wait_for(rf"group sched1 handed over from {MASTER} to {TARGET} \(offset 10\) at epoch {new}")


def test_admin_handover_that_does_not_happen_in_time_says_so(
    metaserver: MetaserverProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    replicated_group(metaserver.address)
    assert main(["admin", "handover", "sched1", "--meta", metaserver.address, "--wait", "300ms"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith(f"group sched1: handover from {MASTER} to {TARGET} asked at epoch ")
    assert err.startswith(f"delaymq admin handover: group sched1: {TARGET} is not master after 300ms (master {MASTER}")


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["nope"], "HANDOVER: group: unknown group 'nope'"),
        (["rt1"], "group 'rt1' is not replicated"),
        (["sched1", "--to", "10.9.9.9:1"], "to: 10.9.9.9:1 is not a server of group 'sched1'"),
        (["sched1", "--to", MASTER], f"to: {MASTER} is already the master of group 'sched1'"),
    ],
)
def test_admin_handover_refusals_are_one_line_naming_the_reason(
    metaserver: MetaserverProcess, capsys: pytest.CaptureFixture[str], argv: list[str], complaint: str
) -> None:
    register(metaserver.address, "rt1", "10.0.0.9:20881")
    replicated_group(metaserver.address)
    assert main(["admin", "handover", *argv, "--meta", metaserver.address]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"delaymq admin handover: metaserver {metaserver.address} refused" in err and complaint in err


def test_metaserver_failover_after_is_an_option_checked_before_starting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from delaymq.cli.main import parse_args

    assert options.duration_ms(parse_args(["metaserver"]).failover_after) == 1_000
    assert main(["metaserver", "--data", str(tmp_path), "--failover-after", "4ms"]) == 2
    assert "--failover-after (4ms) must be at least 5ms" in caplog.text
    assert not any(tmp_path.iterdir())
