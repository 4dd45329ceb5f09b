"""``delaymq cluster`` runs each server as its own supervised child process, as in production.

Each server (replicas too) is a process of its own that answers STATUS on the address the
cluster prints; one SIGTERM stops them all; a SIGKILLed server is reported and started
again on its data and address (what it had accepted is still delivered); and SIGKILL of
the cluster process itself leaves no server behind.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from delaymq.bench.cluster import process_tree, server_processes

pytestmark = pytest.mark.slow


@dataclass
class RunningCluster:
    """A ``delaymq cluster`` child: its printed addresses and its standard error as it comes."""

    process: subprocess.Popen[str]
    addresses: dict[str, list[str]]
    lines: list[str] = field(default_factory=list)
    grew: threading.Condition = field(default_factory=threading.Condition)

    @property
    def meta(self) -> str:
        return self.addresses["metaserver"][0]

    def servers(self) -> dict[str, str]:
        """Server name (its data folder) -> address, as printed."""
        named = {"metaserver": self.meta}
        for kind in ("realtime", "scheduler"):
            master, *replicas = self.addresses[kind]
            named[f"{kind}-1"] = master
            named.update({f"{kind}-1-replica-{k}": address for k, address in enumerate(replicas, 1)})
        return named

    def children(self) -> list[int]:
        return process_tree(self.process.pid)[1:]

    def wait_for_line(self, pattern: str, *, timeout: float = 30.0) -> re.Match[str]:
        """The first line of its standard error that matches ``pattern``, waiting for it."""
        deadline = time.monotonic() + timeout
        with self.grew:
            while True:
                for line in self.lines:
                    if match := re.search(pattern, line):
                        return match
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no line matches {pattern!r}:\n" + "".join(self.lines)
                self.grew.wait(remaining)

    def read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self.grew:
                self.lines.append(line)
                self.grew.notify_all()


@contextmanager
def cluster(data: Path, *extra: str) -> Iterator[RunningCluster]:
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "warning", "cluster", "--data", str(data),
         "--meta-listen", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "DELAYMQ_TOKEN": ""},
    )  # fmt: skip
    running = RunningCluster(process, {})
    reader = threading.Thread(target=running.read_stderr, daemon=True)
    reader.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if match := re.match(r"(metaserver|realtime|scheduler)\s+(\S+)", line):
                running.addresses.setdefault(match[1], []).append(match[2])
            if line.startswith("Ctrl-C"):
                break
        assert "metaserver" in running.addresses, f"the cluster did not start: {process.wait()} {running.lines}"
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        reader.join(timeout=30)


def delaymq(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-P", "-m", "delaymq.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def wait_until_gone(pids: list[int], *, timeout: float) -> list[int]:
    """Wait (on pidfds) until every process of ``pids`` has exited; those still running after ``timeout``."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:  # gone already
            pass
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        running = set(fds)
        deadline = time.monotonic() + timeout
        while running and (remaining := deadline - time.monotonic()) > 0:
            for fd, _events in poller.poll(remaining * 1000):
                running.discard(fd)
                poller.unregister(fd)
        return sorted(fds[fd] for fd in running)
    finally:
        for fd in fds:
            os.close(fd)


def processes_using(folder: Path) -> list[str]:
    """Command lines of every process on the machine that names ``folder`` (a server on its data)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(folder) in command:
                found.append(f"{entry}: {command}")
    return found


def test_each_server_runs_in_a_process_of_its_own_and_none_outlives_a_sigkilled_cluster(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    with cluster(
        data, "--replicas", "1", "--send-interval", "7ms", "--send-ahead", "30ms", "--load-ahead", "9s"
    ) as running:
        servers = running.servers()
        assert len(servers) == 5
        pids = server_processes(running.process.pid, servers)
        # Every server's listening socket is held by a child of its own, none by the cluster process.
        assert set(pids) == {*servers, "cluster supervisor"}, pids
        assert len(set(pids.values())) == 6
        children = running.children()
        assert sorted(children) == sorted(pid for name, pid in pids.items() if name in servers)
        for name, pid in pids.items():
            if name in servers:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                kind = name.split("-")[0].encode()
                assert command[command.index(b"delaymq.cli") + 3] == kind  # delaymq --log-level L KIND ...
                assert str(data / name).encode() in command  # --data DATA/NAME
                # The cluster's --send-interval, --send-ahead and --load-ahead go to its schedulers.
                if kind == b"scheduler":
                    assert command[command.index(b"--send-interval") + 1] == b"7ms"
                    assert command[command.index(b"--send-ahead") + 1] == b"30ms"
                    assert command[command.index(b"--load-ahead") + 1] == b"9000ms"
                else:
                    assert b"--send-interval" not in command and b"--send-ahead" not in command
                    assert b"--load-ahead" not in command
        # Each answers STATUS (the metaserver the routes, each member its own).
        answer: dict[str, Any] = json.loads(delaymq("status", "--json", "--meta", running.meta).stdout)
        asked = {**answer["realtime"], **answer["schedulers"]}
        assert set(asked) == {f"{name.split('-')[0]}-1 {servers[name]}" for name in servers if name != "metaserver"}
        assert not [key for key, status in asked.items() if "error" in status], asked

        running.process.send_signal(signal.SIGKILL)
        running.process.wait(timeout=30)
        assert wait_until_gone(children, timeout=10) == []
    assert processes_using(data) == []


def test_the_servers_get_the_clusters_token_in_their_environment_never_on_their_command_line(
    tmp_path: Path,
) -> None:
    secret = "cluster-server-secret-0123456789"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[token]]\nname = "cluster"\ntoken = "{secret}"\nroles = ["server"]\n'
        'servers = ["realtime:realtime-1", "scheduler:scheduler-1"]\n'
    )
    # Each server announces its address once registered with the metaserver, which checks its token.
    with cluster(tmp_path / "cluster", "--tokens-file", str(tokens), "--token", secret) as running:
        children = running.children()
        assert len(children) == 3
        for pid in children:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert secret.encode() not in command and b"--token\0" not in command
            assert str(tokens).encode() in command  # the tokens file is passed on as an option
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"DELAYMQ_TOKEN={secret}".encode() in environment
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=30) == 0
    assert "unexpectedly" not in "".join(running.lines)


def test_sigterm_stops_every_server_and_then_the_cluster(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    with cluster(data) as running:
        children = running.children()
        assert len(children) == 3
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=30) == 0  # it returns once they are all gone ...
        assert wait_until_gone(children, timeout=0) == []
    assert processes_using(data) == []
    assert "has not stopped; killing it" not in "".join(running.lines)  # ... each stopped by itself on SIGTERM
    assert "unexpectedly" not in "".join(running.lines)


def test_a_sigkilled_server_is_reported_and_serves_again_on_its_address_with_its_data(tmp_path: Path) -> None:
    with cluster(tmp_path / "cluster") as running:
        servers = running.servers()
        meta = running.meta
        now = delaymq("send", "--meta", meta, "kept", "sent-now").stdout.split()
        later = delaymq("send", "--meta", meta, "kept", "sent-for-later", "--delay", "3s").stdout.split()
        before = server_processes(running.process.pid, servers)
        for name in ("realtime-1", "scheduler-1"):
            os.kill(before[name], signal.SIGKILL)
            report = running.wait_for_line(rf"ERROR .*{name} \(pid (\d+) on (\S+)\) exited unexpectedly with (.*?);")
            assert (int(report[1]), report[2], report[3]) == (before[name], servers[name], "signal SIGKILL")
            running.wait_for_line(rf"WARNING .*{name} is back \(pid \d+ on {re.escape(servers[name])}\)")
        after = server_processes(running.process.pid, servers)
        assert set(after) == set(before)  # every server still has a listening child of its own ...
        assert (
            after["realtime-1"] != before["realtime-1"] and after["scheduler-1"] != before["scheduler-1"]
        )  # a new one
        assert after["metaserver"] == before["metaserver"]

        # What each had accepted before it was killed is delivered: the realtime server's from its
        # logs, the scheduler's at its moment.
        received = delaymq(
            "consume", "--meta", meta, "kept", "--group", "g", "--from", "earliest", "--max", "2", "--json",
            "--timeout", "60s",
        ).stdout.splitlines()  # fmt: skip
        assert sorted(json.loads(line)["id"] for line in received) == sorted(now + later)
        assert "".join(running.lines).count("exited unexpectedly") == 2  # the two it killed, nothing else


def test_a_server_that_cannot_start_ends_the_cluster_with_one_line_and_leaves_nothing_running(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    with socket.socket() as squatter:  # the realtime server's port is taken: the metaserver starts, it cannot
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = f"127.0.0.1:{squatter.getsockname()[1]}"
        done = subprocess.run(
            [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "warning", "cluster", "--data", str(data),
             "--meta-listen", "127.0.0.1:0", "--realtime-listen", taken],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""  # no address announced: it never served
    assert (
        f"cannot run the local cluster with data {data}: realtime-1 exited with exit status 1 before it was ready: "
        f"cannot run realtime server realtime-1 on {taken} with data {data / 'realtime-1'}: [Errno 98]"
    ) in done.stderr
    assert "Traceback" not in done.stderr
    assert processes_using(data) == []


def test_the_commands_send_ahead_by_default_within_the_dispatchers_limit() -> None:
    """The command line names its limit as text (it does not import the scheduler to start
    sooner): it must be ``Dispatcher``'s. Both commands send 100 ms ahead, every 60 ms: the
    interval and a round trip fit in the time sent ahead, which stays below a consumer's
    default ``fetch_ahead`` (so one PULL takes each SEND's messages)."""
    from delaymq.cli.main import build_parser
    from delaymq.cli.options import duration_ms
    from delaymq.cli.scheduler_command import MAX_SEND_AHEAD_MS as COMMAND_MAX
    from delaymq.client.delivery import DEFAULT_FETCH_AHEAD
    from delaymq.scheduler.dispatcher import MAX_SEND_AHEAD_MS
    from delaymq.scheduler.wheelset import DEFAULT_LOAD_AHEAD_MS

    assert COMMAND_MAX == MAX_SEND_AHEAD_MS
    parser, _commands = build_parser()
    for argv in (["scheduler", "--data", "d"], ["cluster"]):
        args = parser.parse_args(argv)
        assert (duration_ms(args.send_ahead), duration_ms(args.send_interval)) == (100, 60)
        assert duration_ms(args.load_ahead) == DEFAULT_LOAD_AHEAD_MS  # the command reads ahead as the wheel does
    assert 100 < DEFAULT_FETCH_AHEAD * 1000


def test_a_send_ahead_over_the_limit_is_refused_naming_the_option(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-P", "-m", "delaymq.cli", "scheduler", "--data", str(tmp_path / "s"), "--send-ahead", "11s"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--send-ahead: 11000 ms is over the limit of 10000 ms" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "s").exists()
