"""Network partitions: links between real server processes cut under load, then healed.

Every server (a metaserver, a scheduler group, a realtime group) is a ``delaymq`` process in a
network namespace of its own on a private bridge (``tests/support/netns.py``); the group under
test has a master and ``SLAVES`` slaves. A load in a namespace of its own, outside every cut,
schedules messages due 1-4 s ahead and sends immediate ones (each batch again with the same ids
until a group takes it), takes and acks everything, and samples every server's STATUS
(``tests/faults/partitions/load.py``). A link is then cut for ``CUT_S`` (silently: nftables
drops in the hub, or a veth set down) and healed:

- the master cut from the metaserver only, one way (what it sends the metaserver is lost; it
  keeps its clients and slaves);
- the master cut from the metaserver and its slaves, still reachable by the clients;
- a slave cut from everyone; the metaserver cut from everyone;
- the scheduler group's master cut from the realtime group's master;
- the master's link flapping (down ``FLAP_CUT_S``, up ``FLAP_UP_S``, for ``FLAP_FOR_S``;
  each time the link of whichever member is master then).

Each for a replicated scheduler group and for a replicated realtime group. Each asserts: no
acknowledged message lost, none received before its deliver_at, none received again unmarked,
no write acknowledged by two masters of one group (member STATUS: one master per epoch; and no
write answered by a master that was asked for it after a member of a newer epoch had said it
was master or had answered a write), and service back within ``FAILOVER_AFTER_MS`` of the heal. The failover time and min-insync are passed on every
command line. Each scenario prints one line in the fault suite's figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..support.netns import remove_stale, unavailable
from .partitions.cluster import REALTIME_GROUP, SCHEDULER_GROUP, Cluster, Settings, open_cluster
from .partitions.observations import Verdict, judge

pytestmark = [pytest.mark.faults, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

#: The metaserver's --failover-after, and the bound on heal-to-service-back.
FAILOVER_AFTER_MS = 1_000
#: Every member's --min-insync (the other group's single member runs with 0).
MIN_INSYNC = 0
SLAVES = 2
#: How long a link stays cut.
CUT_S = 5.0
#: The flapping link: down this long, up this long, for this long in all.
FLAP_CUT_S = 2.0
FLAP_UP_S = 2.0
FLAP_FOR_S = 24.0
#: Load before the cut, and after the heal before the producers stop.
WARMUP_S = 3.0
AFTER_HEAL_S = 4.0
#: A write answered within this of its first try, a message received within this of its
#: deliver_at, is served; service is back once both are and nothing slower finishes later.
SERVED_WITHIN_MS = 1_000
#: Below this many acknowledged messages the load did not run and nothing was tested.
LEAST_ACKNOWLEDGED = 500
#: Two producers of scheduled messages and two of immediate ones: batches of 5 every 100 ms.
LOAD: dict[str, Any] = {
    "streams": [*[{"batch": 5, "interval": 0.1, "delay": [1.0, 4.0]}] * 2, *[{"batch": 5, "interval": 0.1}] * 2],
    "drain_s": 20.0,
    "watch_interval": 0.1,
}


def master_cut_from_meta(cluster: Cluster) -> None:
    cluster.net.drop(cluster.master().node, cluster.meta.node)


def master_cut_from_meta_and_slaves(cluster: Cluster) -> None:
    cluster.net.cut(cluster.master().node, [cluster.meta.node, *(slave.node for slave in cluster.slaves())])


def slave_cut(cluster: Cluster) -> None:
    cluster.net.isolate(cluster.slaves()[0].node)


def meta_cut_from_everyone(cluster: Cluster) -> None:
    cluster.net.isolate(cluster.meta.node)


def realtime_master_cut_from_scheduler(cluster: Cluster) -> None:
    cluster.net.cut(cluster.master(SCHEDULER_GROUP).node, [cluster.master(REALTIME_GROUP).node])


def flapping_link(cluster: Cluster) -> None:
    """The current master's link down and up again and again; returns healed."""
    ends = time.monotonic() + FLAP_FOR_S
    while time.monotonic() < ends:
        cluster.net.isolate(cluster.master().node)
        time.sleep(FLAP_CUT_S)  # scenario time
        cluster.net.heal()
        time.sleep(FLAP_UP_S)  # scenario time


#: Each cuts and returns; the test heals ``CUT_S`` later (the flapping link heals itself).
CUTS: dict[str, Callable[[Cluster], None]] = {
    "master-cut-from-meta-one-way": master_cut_from_meta,
    "master-cut-from-meta-and-slaves": master_cut_from_meta_and_slaves,
    "slave-cut": slave_cut,
    "meta-cut-from-everyone": meta_cut_from_everyone,
    "realtime-master-cut-from-scheduler": realtime_master_cut_from_scheduler,
    "flapping-link": flapping_link,
}
CASES = [(kind, name) for kind in ("scheduler", "realtime") for name in CUTS]


@pytest.fixture(scope="module", autouse=True)
def no_stale_namespaces() -> Iterator[None]:
    """Namespaces left by a run that was killed before its finalizers ran are removed first."""
    remove_stale()
    yield


def cut_and_heal(cluster: Cluster, name: str) -> int:
    """Cut as ``name`` says, under load; heal; the wall-clock ms of the heal."""
    CUTS[name](cluster)
    if name != "flapping-link":
        time.sleep(CUT_S)  # scenario time
        cluster.net.heal()
    return time.time_ns() // 1_000_000


def run_scenario(root: Path, kind: str, name: str) -> Verdict:
    """A cluster under load, cut and healed as ``name`` says; the verdict on what the load saw."""
    settings = Settings(kind, FAILOVER_AFTER_MS, MIN_INSYNC, SLAVES, load=LOAD)
    with open_cluster(root, settings) as cluster:
        cluster.control("go")
        cluster.wait_acknowledged(1, timeout=30)
        time.sleep(WARMUP_S)  # scenario time
        healed_at = cut_and_heal(cluster, name)
        time.sleep(AFTER_HEAL_S)  # scenario time
        cluster.control("stop")
        cluster.wait_load_done(timeout=float(LOAD["drain_s"]) + 30)
        groups = cluster.groups()
    return judge(cluster.observations, groups, healed_at=healed_at, served_within_ms=SERVED_WITHIN_MS)


@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{kind}-{name}" for kind, name in CASES])
def test_a_cut_link_loses_nothing_delivers_nothing_early_or_twice_and_service_is_back_after_the_heal(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any, kind: str, name: str
) -> None:
    # Inside the crash watch: the line is printed and the assertions run even when a server
    # logged a traceback, which is then reported first.
    with servers_must_not_crash(tmp_path):
        verdict = run_scenario(tmp_path, kind, name)
        back = verdict.service_back_ms
        fault_report.record(
            scenario=f"{kind}/{name}",
            acknowledged=verdict.acknowledged,
            delivered=verdict.delivered,
            lost=len(verdict.lost),
            early=len(verdict.early),
            duplicated=len(verdict.duplicated),
            max_lateness_ms=max(verdict.lateness_ms, default=0),
            heal_to_service_ms="never" if back is None else back,
            p99_lateness_ms=verdict.percentile(0.99),
            redelivered_marked=verdict.redelivered,
            longest_ack_gap_ms=verdict.longest_ack_gap_ms,
            master_epochs=verdict.master_epochs.get(SCHEDULER_GROUP if kind == "scheduler" else REALTIME_GROUP, 0),
            two_masters=len(verdict.two_masters),
            unattributed_writes=verdict.unattributed_writes,
        )
        assert verdict.acknowledged >= LEAST_ACKNOWLEDGED, f"the load did not run: {verdict.acknowledged} acknowledged"
        assert not verdict.lost, (
            f"{len(verdict.lost)} acknowledged message(s) never arrived, e.g. {verdict.lost[:3]}; "
            f"acknowledged by {verdict.lost_answered_by}"
        )
        assert not verdict.early, f"received before deliver_at: {verdict.early[:5]}"
        assert not verdict.duplicated, f"received again, attempts not raised: {verdict.duplicated[:5]}"
        assert not verdict.two_masters, verdict.two_masters[:5]
        assert back is not None and back <= FAILOVER_AFTER_MS, f"service back {back} ms after the heal"
