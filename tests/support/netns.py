"""Network namespaces on a private bridge, for tests that cut the links between processes.

Each node (a server, or the clients) is a network namespace of its own, joined by one veth pair
to a "hub" namespace that holds the bridge, so nothing is added to the host's own network. The
addresses come from one private /24 that exists only inside those namespaces. A link is cut
in one direction by an nftables rule in the hub's bridge table dropping what one node sends to
another: silently, as a dead link does (a blackhole route inside the sender's namespace would
instead fail its connects at once). ``isolate`` sets a node's veth down: cut from everyone.

Namespace names carry ``PREFIX``, the test process's pid and a counter, so runs side by side
never meet; ``close`` removes them all, and ``remove_stale`` those of runs that died.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

#: Every namespace this module makes starts with it (then the pid of the process that made it).
PREFIX = "dmqp"
#: The /24 the nodes' addresses come from: .2 onwards, inside the namespaces only.
SUBNET = "10.213.0"
_TABLE = "partition"
_networks = itertools.count(1)


class NetnsUnavailable(RuntimeError):
    """This machine (or user) cannot make namespaces, veth pairs, bridges or nftables rules."""


def unavailable() -> str | None:
    """Why a ``Network`` cannot be made here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (iproute2, nftables: `make faults` installs them as root)"
    return None


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Node:
    """A namespace on the bridge: ``name`` (short), its namespace, its address and its veth's hub end."""

    name: str
    netns: str
    address: str
    hub_port: str

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Network:
    """A hub namespace with a bridge, and nodes added to it; cut and heal links between them."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}x{next(_networks)}"
        self.hub = f"{self.tag}-hub"
        self.nodes: list[Node] = []
        self._namespaces: list[str] = []
        try:
            self._add_namespace(self.hub)
            self._hub("ip", "link", "add", "br0", "type", "bridge")
            self._hub("ip", "link", "set", "br0", "up")
            # One bridge-family table: every rule in its forward chain drops one direction of one pair.
            self._hub("nft", "add", "table", "bridge", _TABLE)
            chain = "{ type filter hook forward priority 0; policy accept; }"
            self._hub("nft", "add", "chain", "bridge", _TABLE, "forward", chain)
        except BaseException:
            self.close()
            raise

    def _hub(self, *argv: str) -> str:
        return _run(["ip", "netns", "exec", self.hub, *argv])

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def add(self, name: str) -> Node:
        """A new namespace joined to the bridge, with the next address of ``SUBNET``."""
        node = Node(name, f"{self.tag}-{name}", f"{SUBNET}.{len(self.nodes) + 2}", f"v-{len(self.nodes)}")
        self._add_namespace(node.netns)
        # Made inside the hub with its peer put straight into the node: no name ever in the host's namespace.
        _run(["ip", "-n", self.hub, "link", "add", node.hub_port, "type", "veth", "peer", "name", "eth0"]
             + ["netns", node.netns])  # fmt: skip
        _run(["ip", "-n", self.hub, "link", "set", node.hub_port, "master", "br0", "up"])
        _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0"])
        _run(["ip", "-n", node.netns, "link", "set", "eth0", "up"])
        self.nodes.append(node)
        return node

    def drop(self, source: Node, target: Node) -> None:
        """Cut one direction: what ``source`` sends to ``target`` is lost (the other way still flows)."""
        rule = ["ip", "saddr", source.address, "ip", "daddr", target.address, "drop"]
        self._hub("nft", "add", "rule", "bridge", _TABLE, "forward", *rule)

    def cut(self, a: Node, others: Sequence[Node]) -> None:
        """Cut ``a`` from each of ``others``, both ways."""
        for other in others:
            self.drop(a, other)
            self.drop(other, a)

    def isolate(self, node: Node) -> None:
        """Cut ``node`` from everyone: its veth's hub end goes down."""
        _run(["ip", "-n", self.hub, "link", "set", node.hub_port, "down"])

    def heal(self) -> None:
        """Every cut healed: no drop rule, every veth up."""
        self._hub("nft", "flush", "chain", "bridge", _TABLE, "forward")
        for node in self.nodes:
            _run(["ip", "-n", self.hub, "link", "set", node.hub_port, "up"])

    def close(self) -> None:
        """Remove every namespace made (their veths and the bridge go with them); carries on past failures."""
        errors = []
        for name in reversed(self._namespaces):
            try:
                _run(["ip", "netns", "delete", name])
            except NetnsUnavailable as error:
                errors.append(str(error))
        self._namespaces.clear()
        if errors:
            raise NetnsUnavailable("; ".join(errors))


def remove_stale() -> list[str]:
    """Remove namespaces of ``PREFIX`` whose process is gone (a run killed before its finalizers); their names."""
    removed = []
    for line in _run(["ip", "netns", "list"]).splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("x", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            _run(["ip", "netns", "delete", name])
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True
