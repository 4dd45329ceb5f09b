"""A delaymq cluster whose every process runs in a network namespace of its own (``tests/support/netns.py``).

A metaserver, a scheduler group and a realtime group: the group under test (``kind``) has a
master and ``slaves`` slaves, the other one member (``--min-insync 0``). Each server is the
``delaymq`` command a deployment runs, started with ``ip netns exec``, listening on its
namespace's address (the namespaces' network is private to the test, so without a tokens file:
``--insecure-listen``). The load (``load.py``) runs in a namespace of its own, outside every cut,
and the test reads what it writes (``Observations``): the test's process only drives ``ip`` and
``nft`` and reads files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...support.netns import Network, Node
from ...support.polling import poll_until
from .observations import Observations

SCHEDULER_GROUP = "scheduler-1"
REALTIME_GROUP = "realtime-1"
#: Every server listens on this port of its own namespace's address.
PORT = 7000
#: How long a server may take to log that it listens, and a group to be ready.
START_TIMEOUT_S = 30.0
LOAD_SCRIPT = Path(__file__).with_name("load.py")


@dataclass
class Settings:
    """What a scenario's cluster runs with; the failover time and min-insync go on every command line."""

    kind: str  # "scheduler" or "realtime": which group is replicated
    failover_after_ms: int
    min_insync: int
    slaves: int
    ack_timeout: str = "5s"  # a hand-out whose ack was lost comes back this soon, marked
    load: dict[str, Any] = field(default_factory=dict)  # load.py's config: streams, drain_s, watch_interval


@dataclass
class Server:
    """One ``delaymq`` server process in its namespace."""

    name: str
    node: Node
    group: str  # its server group, or "meta"
    arguments: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.node.address}:{PORT}"

    def start(self) -> None:
        command = [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "info", *self.arguments]
        command += ["--listen", self.address, "--insecure-listen"]
        with self.log_path.open("ab") as log:
            log.write(f"---- start of {self.name}: {' '.join(command[3:])}\n".encode())
            log.flush()
            self.process = subprocess.Popen(self.node.exec_argv(command), stdout=log, stderr=subprocess.STDOUT)

    def wait_listening(self) -> None:
        def listening() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            return f" listening on {self.address}" in self.log_path.read_text(errors="replace")

        poll_until(listening, timeout=START_TIMEOUT_S, interval=0.05, what=f"{self.name} to listen")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@dataclass
class Cluster:
    settings: Settings
    root: Path
    net: Network
    meta: Server
    schedulers: list[Server]
    realtimes: list[Server]
    load_node: Node
    observations: Observations
    load: subprocess.Popen[bytes] | None = None

    @property
    def servers(self) -> list[Server]:
        return [self.meta, *self.schedulers, *self.realtimes]

    @property
    def group(self) -> str:
        """The replicated group's name."""
        return SCHEDULER_GROUP if self.settings.kind == "scheduler" else REALTIME_GROUP

    @property
    def members(self) -> list[Server]:
        """The replicated group's members."""
        return self.schedulers if self.settings.kind == "scheduler" else self.realtimes

    def groups(self) -> dict[str, str]:
        """Each server's address: its group."""
        return {server.address: server.group for server in self.servers}

    def by_address(self, address: str) -> Server:
        (server,) = [s for s in self.servers if s.address == address]
        return server

    def master(self, group: str | None = None) -> Server:
        """The master of ``group`` (the replicated one by default), as the metaserver last said."""
        address = poll_until(
            lambda: self.observations.master_of(group or self.group),
            timeout=START_TIMEOUT_S, interval=0.05, what=f"a master of {group or self.group}",
        )  # fmt: skip
        assert address is not None  # poll_until returns once it is
        return self.by_address(address)

    def slaves(self) -> list[Server]:
        master = self.master()
        return [member for member in self.members if member is not master]

    def wait_ready(self, *, timeout: float = START_TIMEOUT_S) -> None:
        """Until both groups have a master and the replicated one every slave in sync."""
        want = {SCHEDULER_GROUP: 0, REALTIME_GROUP: 0}
        want[self.group] = self.settings.slaves
        poll_until(lambda: self.observations.ready(want), timeout=timeout, interval=0.1, what="the groups in sync")

    def control(self, name: str) -> None:
        """Create the load's control file ``go`` or ``stop``."""
        (self.observations.out / name).write_text("")

    def load_running(self) -> bool:
        """True while the load runs; an AssertionError once it exited without writing ``done``."""
        assert self.load is not None
        if self.load.poll() is not None and not (self.observations.out / "done").exists():
            raise AssertionError(f"the load exited with {self.load.returncode}; see {self.root / 'load.log'}")
        return self.load.returncode is None

    def wait_acknowledged(self, count: int, *, timeout: float) -> None:
        """Until the load holds ``count`` acknowledgements."""
        poll_until(
            lambda: self.load_running() and self.observations.acknowledged() >= count,
            timeout=timeout, interval=0.1, what=f"{count} acknowledged",
        )  # fmt: skip

    def wait_load_done(self, *, timeout: float) -> None:
        """Until the load drained and exited (``stop`` first)."""
        poll_until(lambda: not self.load_running(), timeout=timeout, interval=0.1, what="the load to drain")


def _server_arguments(settings: Settings, kind: str, data: Path, meta: str) -> list[str]:
    replicated = kind == settings.kind
    arguments = [kind, "--meta", meta, "--data", str(data), "--replication", "sync"]
    arguments += ["--group", SCHEDULER_GROUP if kind == "scheduler" else REALTIME_GROUP]
    arguments += ["--min-insync", str(settings.min_insync if replicated else 0)]
    if kind == "realtime":
        arguments += ["--ack-timeout", settings.ack_timeout]
    return arguments


def _build(settings: Settings, root: Path, net: Network) -> Cluster:
    meta_node = net.add("meta")
    meta = Server("meta", meta_node, "meta", [], root / "meta.log")
    meta.arguments = ["metaserver", "--data", str(root / "meta"), "--failover-after", f"{settings.failover_after_ms}ms"]
    members: dict[str, list[Server]] = {"scheduler": [], "realtime": []}
    for kind in ("scheduler", "realtime"):
        count = 1 + settings.slaves if kind == settings.kind else 1
        for n in range(1, count + 1):
            name = f"{kind[0]}{n}"
            node = net.add(name)
            group = SCHEDULER_GROUP if kind == "scheduler" else REALTIME_GROUP
            arguments = _server_arguments(settings, kind, root / name, meta.address)
            members[kind].append(Server(name, node, group, arguments, root / f"{name}.log"))
    load_node = net.add("load")
    observations = Observations(root / "load")
    return Cluster(settings, root, net, meta, members["scheduler"], members["realtime"], load_node, observations)


def _start_load(cluster: Cluster) -> None:
    out = cluster.observations.out
    out.mkdir(parents=True, exist_ok=True)
    watch: dict[str, list[str]] = {"meta": [cluster.meta.address]}
    for server in [*cluster.schedulers, *cluster.realtimes]:
        watch.setdefault(server.group, []).append(server.address)
    config = {"meta": cluster.meta.address, "out": str(out), "watch": watch, "subject": "partitions"}
    config.update(cluster.settings.load)
    (out / "config.json").write_text(json.dumps(config))
    command = [sys.executable, "-P", str(LOAD_SCRIPT), str(out / "config.json")]
    with (cluster.root / "load.log").open("ab") as log:
        cluster.load = subprocess.Popen(cluster.load_node.exec_argv(command), stdout=log, stderr=subprocess.STDOUT)


@contextmanager
def open_cluster(root: Path, settings: Settings) -> Iterator[Cluster]:
    """Namespaces, servers and the load's watcher started (the load waits for ``go``); every process
    SIGKILLed and every namespace removed at the end, whatever happened."""
    with ExitStack() as stack:
        net = Network()
        stack.callback(net.close)
        cluster = _build(settings, root, net)
        stack.callback(_kill_all, cluster)
        cluster.meta.start()
        cluster.meta.wait_listening()
        for server in [*cluster.schedulers, *cluster.realtimes]:
            server.start()
        for server in [*cluster.schedulers, *cluster.realtimes]:
            server.wait_listening()
        _start_load(cluster)
        cluster.wait_ready()
        yield cluster


def _kill_all(cluster: Cluster) -> None:
    if cluster.load is not None and cluster.load.poll() is None:
        cluster.load.kill()
        cluster.load.wait(timeout=30)
    for server in cluster.servers:
        server.kill()
