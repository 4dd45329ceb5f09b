"""``delaymq bench failover``: a replicated scheduler (or, ``--realtime``, realtime) group whose
master is SIGKILLed, then one whose master hands over.

Every server is its own ``delaymq`` process, as in production, with the commands'
defaults (the metaserver's 1 s ``--failover-after``, sync replication, ``--min-insync
0``): a metaserver, a realtime server, a scheduler master and a slave
(``ReplicatedGroup``; the fault tests in tests/faults/test_faults_scheduler_failover.py
use it too). One producer schedules N messages due over the next ~20 s, one consumer
takes them; the master is killed at a chosen moment and the slave takes over; then the
same with ``delaymq admin handover`` instead of the kill. Printed, never asserted:

- the time from the kill (or the handover asked) to the new master's promotion and to
  its first dispatch (its STATUS, polled every 10 ms);
- lateness p50/p99/max of the messages due while the group changed master;
- the producer's error time: from its first failed send to its last (0: none failed);
- re-sends absorbed by the realtime server's id dedup (its ``duplicates``);
- lost / early / duplicated at the consumer;
- the accept rate of one producer (batches of 100, four in flight) into a fresh group
  with sync replication to one slave beside the same into a group of one member, as a
  ratio (the goal is >= 0.9: docs/performance.md, "Goals").

``--realtime``: a metaserver and a realtime group of a master and two sync slaves.
One producer sends immediate messages at a steady rate, one consumer takes and acks
them; the master is SIGKILLed under that load, then (a fresh group) handed over. Printed: the time from the kill to the
promotion, to the first SEND the new master stored and to the first message it handed
out (its STATUS, polled every 10 ms), and what the consumer saw: lost, handed out again
with a raised ``attempts`` (marked: a hand-out whose ack the old master had not
replicated), and handed out again unmarked (duplicated).
"""

from __future__ import annotations

import random
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from delaymq.bench.cluster import IN_FLIGHT, Row, bench_batches, percentiles
from delaymq.client import open_consumer, open_producer
from delaymq.client.producer import Producer
from delaymq.net.peers import AsyncCaller, open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.records import Message

SUBJECT = "failover"
GROUP = "scheduler-1"
REALTIME_GROUP = "realtime-1"
#: How long a server process may take to log its address.
START_TIMEOUT_S = 30.0
_LISTENING = re.compile(rb" listening on (\S+)")


def wall_ms() -> int:
    """The machine's clock in epoch ms: what the servers' SystemClock and the consumer's ``received_at`` read."""
    return time.time_ns() // 1_000_000


@dataclass
class ServerChild:
    """One ``delaymq <command>`` server in a child process, started again at will.

    Its log goes to ``log_path`` (appended across restarts); its address is read from
    the ``... listening on HOST:PORT`` line it logs once it serves.
    """

    name: str
    arguments: list[str]  # after ``delaymq --log-level info``; ``--listen`` is added by ``start``
    log_path: Path
    process: trio.Process | None = None
    address: str = ""
    starts: int = 0

    async def start(self, *, listen: str = "127.0.0.1:0") -> str:
        """Start it (a free port unless ``listen`` names one); returns once it logged its address."""
        assert self.process is None or self.process.returncode is not None, f"{self.name} is running"
        command = [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "info", *self.arguments]
        command += ["--listen", listen]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        async with await trio.open_file(self.log_path, "ab") as log:
            await log.write(f"---- start {self.starts + 1} of {self.name}: {' '.join(command[3:])}\n".encode())
            await log.flush()
            offset = await log.tell()
            self.process = await trio.lowlevel.open_process(command, stdout=log.fileno(), stderr=log.fileno())
        self.starts += 1
        with trio.fail_after(START_TIMEOUT_S):
            while True:
                match = _LISTENING.search(await trio.Path(self.log_path).read_bytes(), offset)
                if match:
                    self.address = match[1].decode()
                    return self.address
                if self.process.returncode is not None:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
                await trio.sleep(0.02)  # polling the log for the line the server writes once it serves

    def send_signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def kill(self) -> None:
        """SIGKILL, as a crash; returns once the process is gone."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def role_of(answer: dict[str, Any]) -> str:
    """A member's role from its STATUS: a scheduler says it at the top, a realtime server in its statistics."""
    return str(answer.get("role") or (answer.get("statistics") or {}).get("role") or "")


def epoch_of(answer: dict[str, Any]) -> int:
    """A member's epoch from its STATUS (at the top for a scheduler, in the statistics for a realtime server)."""
    return int(answer.get("epoch", (answer.get("statistics") or {}).get("epoch", 0)))


@dataclass
class ReplicatedGroup:
    """A metaserver and the members of one replicated group, each a process: a scheduler group
    (``kind="scheduler"``, with the realtime server it delivers to) or a realtime group."""

    root: Path
    peers: AsyncCaller
    meta: ServerChild
    realtime: ServerChild | None  # the realtime server a scheduler group delivers to; None for a realtime group
    members: list[ServerChild]
    failover_after_ms: int | None  # None: the metaserver's default
    min_insync: int
    kind: str = "scheduler"
    member_options: Sequence[str] = ()  # more options of every member's command

    @property
    def name(self) -> str:
        """The replicated group's name."""
        return GROUP if self.kind == "scheduler" else REALTIME_GROUP

    def member(self, name: str, *, replication: str = "sync") -> ServerChild:
        """A member of the group (``delaymq scheduler`` or ``delaymq realtime``) on its own data folder
        (not started)."""
        arguments = [self.kind, "--group", self.name, "--meta", self.meta.address, "--data", str(self.root / name)]
        arguments += ["--replication", replication, "--min-insync", str(self.min_insync), *self.member_options]
        child = ServerChild(name, arguments, self.root / f"{name}.log")
        self.members.append(child)
        return child

    async def status(self, address: str) -> dict[str, Any]:
        """A server's STATUS answer (scheduler, realtime and metaserver all answer command 14)."""
        frame = await self.peers.call(address, Command.STATUS, {}, timeout=5.0)
        return frame.metadata

    async def wait_status(
        self, address: str, predicate: Callable[[dict[str, Any]], bool], *, timeout: float, poll: float = 0.05
    ) -> dict[str, Any]:
        """Poll a server's STATUS until ``predicate`` holds (within ``timeout`` s); the answer that did.

        A server that does not answer (stopped, restarting) is asked again."""
        with trio.fail_after(timeout):
            while True:
                try:
                    answer = await self.status(address)
                except Exception:  # not answering now: asked again at the next poll
                    answer = None
                if answer is not None and predicate(answer):
                    return answer
                await trio.sleep(poll)  # the poll interval of a bounded wait

    async def wait_in_sync(self, master: ServerChild, slave: ServerChild, *, timeout: float = 30.0) -> None:
        """Until the metaserver knows ``slave`` as an in-sync slave of ``master`` (so it can be promoted)."""

        def ready(answer: dict[str, Any]) -> bool:
            rows = {row["address"]: row for row in answer["rows"] if row["group"] == self.name}
            return (
                rows.get(master.address, {}).get("role") == "master"
                and rows.get(slave.address, {}).get("role") == "slave"
                and rows[slave.address].get("in_sync") is True
            )

        await self.wait_status(self.meta.address, ready, timeout=timeout)

    async def start_member(self, child: ServerChild, *, role: str, timeout: float = 30.0) -> dict[str, Any]:
        """Start a member and wait until its STATUS says ``role``; that STATUS."""
        await child.start()
        return await self.wait_status(child.address, lambda answer: role_of(answer) == role, timeout=timeout)

    async def kill_all(self) -> None:
        for child in [*self.members, self.realtime, self.meta]:
            if child is None:
                continue
            if child.process is not None and child.process.returncode is None:
                child.send_signal(signal.SIGCONT)  # a stopped one too
            await child.kill()


@asynccontextmanager
async def open_replicated_group(
    root: Path,
    *,
    kind: str = "scheduler",
    failover_after_ms: int | None = None,
    slaves: int = 1,
    min_insync: int = 0,
    replication: str = "sync",
    member_options: Sequence[str] = (),
) -> AsyncIterator[ReplicatedGroup]:
    """Start a metaserver, the master and ``slaves`` slaves of a ``kind`` group (scheduler: ``s1``,
    ``s2``...; realtime: ``r1``, ``r2``...), each a process, and for a scheduler group the realtime
    server it delivers to (a group of one, ``--min-insync 0``); yields once every slave is in sync as
    the metaserver sees it. All are SIGKILLed at the end."""
    if kind not in ("scheduler", "realtime"):
        raise ValueError(f"kind: {kind!r} is not scheduler or realtime")
    async with open_peers(request_timeout=5.0) as peers:
        meta_arguments = ["metaserver", "--data", str(root / "meta")]
        if failover_after_ms is not None:  # else the metaserver's default
            meta_arguments += ["--failover-after", f"{failover_after_ms}ms"]
        meta = ServerChild("meta", meta_arguments, root / "meta.log")
        realtime = None
        if kind == "scheduler":
            arguments = ["realtime", "--data", str(root / "realtime"), "--min-insync", "0"]
            realtime = ServerChild("realtime", arguments, root / "realtime.log")
        group = ReplicatedGroup(root, peers, meta, realtime, [], failover_after_ms, min_insync, kind, member_options)
        prefix = kind[0]
        try:
            await meta.start()
            if realtime is not None:
                realtime.arguments += ["--meta", meta.address]
                await realtime.start()
            master = group.member(f"{prefix}1", replication=replication)
            await group.start_member(master, role="master")
            for n in range(slaves):
                slave = group.member(f"{prefix}{n + 2}", replication=replication)
                await group.start_member(slave, role="slave")
                await group.wait_in_sync(master, slave)
            yield group
        finally:
            with trio.CancelScope(shield=True):
                await group.kill_all()


# ------------------------------------------------------------------ the producer and the consumer


@dataclass
class Tally:
    """What the producer had acknowledged and what the consumer received, by message id."""

    acked: dict[str, Message] = field(default_factory=dict)
    acked_at: dict[str, int] = field(default_factory=dict)
    received: dict[str, list[int]] = field(default_factory=dict)  # received_at of each delivery
    attempts: dict[str, list[int]] = field(default_factory=dict)  # the attempts count of each delivery
    received_due: dict[str, int] = field(default_factory=dict)  # deliver_at as delivered (rewritten if it was past)
    send_errors: int = 0
    error_ms: list[int] = field(default_factory=list)  # when each failed send failed
    changed: trio.Event = field(default_factory=trio.Event)

    def missing(self) -> set[str]:
        return self.acked.keys() - self.received.keys()

    async def wait_all_in(self, *, timeout: float) -> None:
        """Until every acknowledged message has arrived (``trio.TooSlowError`` after ``timeout``)."""
        with trio.fail_after(timeout):
            while self.missing():
                self.changed = trio.Event()
                await self.changed.wait()

    async def wait_acked(self, count: int, *, timeout: float) -> None:
        """Until the producer holds ``count`` acknowledgements (``trio.TooSlowError`` after ``timeout``)."""
        with trio.fail_after(timeout):
            while len(self.acked) < count:
                self.changed = trio.Event()
                await self.changed.wait()

    def early(self) -> list[str]:
        """Ids received before their deliver_at (as sent, and as delivered), by the machine clock."""
        return [
            i for i, times in self.received.items()
            if min(times) < max(self.received_due[i], self.acked[i].deliver_at if i in self.acked else 0)
        ]  # fmt: skip

    def error_window_ms(self) -> int:
        """From the producer's first failed send to its last (0: none failed)."""
        return max(self.error_ms) - min(self.error_ms) if self.error_ms else 0

    def duplicated(self) -> int:
        return sum(len(times) - 1 for times in self.received.values())

    def handed_out_again(self) -> tuple[int, int]:
        """Deliveries after an id's first: (marked: its attempts count above every earlier one's, so
        the consumer can tell; unmarked: not raised, a duplicate the consumer cannot tell apart)."""
        marked = unmarked = 0
        for counts in self.attempts.values():
            for n, count in enumerate(counts[1:], start=1):
                if count > max(counts[:n]):
                    marked += 1
                else:
                    unmarked += 1
        return marked, unmarked

    def lateness_ms(self, *, due_from: int = 0, due_until: int | None = None) -> list[float]:
        """Receive time minus due time of the first delivery of messages due in [due_from, due_until)."""
        return [
            float(min(times) - self.received_due[i])
            for i, times in self.received.items()
            if due_from <= self.received_due[i] and (due_until is None or self.received_due[i] < due_until)
        ]


async def send_until_stored(producer: Producer, batch: Sequence[Message], tally: Tally) -> None:
    """Send ``batch`` until the group takes it: the same messages (same ids) again after a failure,
    as a user would; only then are they acknowledged."""
    while True:
        try:
            await producer.send_batch(batch)
            break
        except Exception:  # no master right now (failover): the same batch again
            tally.send_errors += 1
            tally.error_ms.append(wall_ms())
            await trio.sleep(0.05)  # a retry backoff, not a synchronisation
    now = wall_ms()
    for message in batch:
        tally.acked[message.id] = message
        tally.acked_at[message.id] = now
    tally.changed.set()


async def consume(meta: str, tally: Tally, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Receive and ack every message of ``SUBJECT`` into ``tally`` until cancelled."""
    async with open_consumer(
        meta, SUBJECT, group="failover", start="earliest", max_messages_held=20_000, pull_batch=1000, poll_timeout=1.0
    ) as consumer:
        task_status.started()
        async for message in consumer:
            tally.received.setdefault(message.id, []).append(message.received_at)
            tally.attempts.setdefault(message.id, []).append(message.attempts)
            tally.received_due.setdefault(message.id, message.deliver_at)
            await message.ack()
            tally.changed.set()


async def send_all(
    meta: str,
    count: int,
    tally: Tally,
    *,
    delay: tuple[float, float] | None,
    batch: int = 100,
    rate: float | None = None,
    latencies_ms: list[float] | None = None,
) -> float:
    """Send ``count`` messages (batches of ``batch``, ``IN_FLIGHT`` in flight), due ``delay`` s ahead or
    immediate (``None``), as fast as they are taken or paced at ``rate`` msg/s; msg/s. Each batch's time
    from its first try to its answer goes into ``latencies_ms``."""
    rng = random.Random(3)
    async with open_producer(meta) as producer:
        window = trio.Semaphore(IN_FLIGHT)
        start = time.perf_counter()
        paced_from = trio.current_time()

        async def send(messages: list[Message]) -> None:
            try:
                began = time.perf_counter()
                await send_until_stored(producer, messages, tally)
                if latencies_ms is not None:
                    latencies_ms.append((time.perf_counter() - began) * 1000)
            finally:
                window.release()

        async with trio.open_nursery() as senders:
            for first, messages in bench_batches(producer, SUBJECT, count, batch, delay, rng):
                if rate is not None:
                    await trio.sleep_until(paced_from + first / rate)  # the producer's pace, not a synchronisation
                await window.acquire()
                senders.start_soon(send, messages)
        return count / (time.perf_counter() - start)


# ------------------------------------------------------------------ the benchmark


@dataclass
class Takeover:
    new_master: ServerChild
    killed_ms: int
    promoted_ms: int
    first_ms: dict[str, int]  # statistics counter -> when the new master first raised it


async def kill_master_and_time_takeover(
    group: ReplicatedGroup,
    master: ServerChild,
    slaves: Sequence[ServerChild],
    counters: Sequence[str],
    *,
    handover: bool = False,
) -> Takeover:
    """SIGKILL ``master`` (``handover``: ask the metaserver to hand its group over instead); poll the
    ``slaves``' STATUS every 10 ms until one is master, then until it has raised each of its statistics
    ``counters`` (``dispatched``, ``messages_stored``...) above where they stood at its promotion."""
    killed = wall_ms()
    if handover:
        await group.peers.call(group.meta.address, Command.HANDOVER, {"group": group.name}, timeout=5.0)
    else:
        await master.kill()
    timeout = (group.failover_after_ms or 0) / 1000 + 30
    try:
        with trio.fail_after(timeout):
            new_master, answer = await _wait_promoted(group, slaves)
            promoted_ms = wall_ms()
            baseline = {name: answer["statistics"][name] for name in counters}
            first_ms: dict[str, int] = {}
            while len(first_ms) < len(counters):
                await trio.sleep(0.01)  # the poll interval of a bounded wait
                try:
                    stats = (await group.status(new_master.address))["statistics"]
                except Exception:  # not answering now: asked again at the next poll
                    continue
                now = wall_ms()
                for name in counters:
                    if name not in first_ms and stats[name] > baseline[name]:
                        first_ms[name] = now
    except trio.TooSlowError:
        states = ", ".join(
            f"{slave.name} {'is running' if slave.process and slave.process.returncode is None else 'exited'}"
            for slave in slaves
        )
        raise RuntimeError(
            f"no slave took over (and served) within {timeout:.0f} s; {states} (see their logs in {group.root})"
        ) from None
    return Takeover(new_master, killed, promoted_ms, first_ms)


async def _wait_promoted(group: ReplicatedGroup, slaves: Sequence[ServerChild]) -> tuple[ServerChild, dict[str, Any]]:
    """The first of ``slaves`` whose STATUS says master (polled every 10 ms), and that STATUS."""
    while True:
        for slave in slaves:
            try:
                answer = await group.status(slave.address)
            except Exception:  # not answering now: asked again at the next poll
                continue
            if role_of(answer) == "master":
                return slave, answer
        await trio.sleep(0.01)  # the poll interval of a bounded wait


async def _failover_run(root: Path, count: int, kill_after: float, *, handover: bool = False) -> list[Row]:
    tally = Tally()
    async with open_replicated_group(root) as group:
        master, slave = group.members
        assert group.realtime is not None
        async with trio.open_nursery() as nursery:
            await nursery.start(consume, group.meta.address, tally)
            started = trio.current_time()
            accepted = 0.0

            async def produce() -> None:
                nonlocal accepted
                accepted = await send_all(group.meta.address, count, tally, delay=(2.0, 20.0), rate=count / 10)

            nursery.start_soon(produce)  # still sending when the master changes: the producer's errors show
            await trio.sleep_until(started + kill_after)  # the chosen moment of the kill, not a synchronisation
            takeover = await kill_master_and_time_takeover(group, master, [slave], ["dispatched"], handover=handover)
            try:
                await tally.wait_acked(count, timeout=60)
                await tally.wait_all_in(timeout=60)
            except trio.TooSlowError:
                pass  # reported as lost
            realtime = await group.status(group.realtime.address)
            nursery.cancel_scope.cancel()
    first_dispatch_ms = takeover.first_ms["dispatched"]
    during = tally.lateness_ms(due_from=takeover.killed_ms, due_until=first_dispatch_ms)
    p50, p99, worst = percentiles(during)
    after_p50, after_p99, after_worst = percentiles(tally.lateness_ms(due_from=first_dispatch_ms))
    change = _change(handover)
    return [
        (f"{count:,} scheduled at {count / 10:,.0f} msg/s, sync to 1 slave: accepted", accepted, "msg/s"),
        (f"{change} to promotion", takeover.promoted_ms - takeover.killed_ms, "ms"),
        (f"{change} to the new master's first dispatch", first_dispatch_ms - takeover.killed_ms, "ms"),
        ("messages due meanwhile", len(during), "msgs"),
        ("  their lateness p50", p50, "ms"),
        ("  their lateness p99", p99, "ms"),
        ("  their lateness max", worst, "ms"),
        ("due after the takeover: lateness p50", after_p50, "ms"),
        ("due after the takeover: lateness p99", after_p99, "ms"),
        ("due after the takeover: lateness max", after_worst, "ms"),
        ("producer: failed sends (retried)", tally.send_errors, ""),
        ("producer: first to last failed send", tally.error_window_ms(), "ms"),
        ("re-sends absorbed by dedup (realtime duplicates)", realtime["statistics"]["duplicates"], "msgs"),
        ("SENDs refused by fencing", realtime["statistics"]["fenced"], ""),
        ("lost", len(tally.missing()), "msgs"),
        ("early", len(tally.early()), "msgs"),
        ("duplicated at the consumer", tally.duplicated(), "msgs"),
    ]


def _change(handover: bool) -> str:
    """How a run's rows name the moment the master changed."""
    return "handover asked" if handover else "kill"


async def _accept_rate(root: Path, count: int, *, slaves: int) -> float:
    """SCHEDULE msg/s of one producer into a fresh group: sync replication to ``slaves`` slaves,
    or one member alone. Due in 60-120 s: nothing is delivered meanwhile."""
    async with open_replicated_group(root, slaves=slaves) as group:
        return await send_all(group.meta.address, count, Tally(), delay=(60.0, 120.0))


#: A realtime member's ack timeout in the realtime failover: a hand-out lost with the old master
#: (its answer never reached the consumer) comes back this soon.
REALTIME_ACK_TIMEOUT = "5s"


async def _realtime_failover_run(
    root: Path, count: int, kill_after: float, rate: float, *, handover: bool = False
) -> list[Row]:
    tally = Tally()
    options = ["--ack-timeout", REALTIME_ACK_TIMEOUT]
    async with open_replicated_group(root, kind="realtime", slaves=2, member_options=options) as group:
        master, *slaves = group.members
        async with trio.open_nursery() as nursery:
            await nursery.start(consume, group.meta.address, tally)
            sent = trio.Event()

            async def produce() -> None:
                await send_all(group.meta.address, count, tally, delay=None, batch=20, rate=rate)
                sent.set()

            nursery.start_soon(produce)
            await trio.sleep(kill_after)  # the chosen moment of the kill, under load; not a synchronisation
            lag = await _replication_lag(group, master)
            takeover = await kill_master_and_time_takeover(
                group, master, slaves, ["messages_stored", "messages_delivered"], handover=handover
            )
            with trio.move_on_after(120):
                await sent.wait()
            try:
                await tally.wait_all_in(timeout=60)
            except trio.TooSlowError:
                pass  # reported as lost
            new_master = await group.status(takeover.new_master.address)
            nursery.cancel_scope.cancel()
    marked, unmarked = tally.handed_out_again()
    stats = new_master["statistics"]
    change = _change(handover)
    return [
        (f"sent at {rate:,.0f} msg/s, sync to 2 slaves: acknowledged", len(tally.acked), "msgs"),
        (f"slaves' lag just before the {'handover' if handover else 'kill'} (most)", lag, "bytes"),
        (f"{change} to promotion", takeover.promoted_ms - takeover.killed_ms, "ms"),
        (
            f"{change} to the first SEND stored by the new master",
            takeover.first_ms["messages_stored"] - takeover.killed_ms,
            "ms",
        ),
        (
            f"{change} to the first message handed out by the new master",
            takeover.first_ms["messages_delivered"] - takeover.killed_ms,
            "ms",
        ),
        ("SEND retries (whole batches) at the producer", tally.send_errors, ""),
        ("producer: first to last failed send", tally.error_window_ms(), "ms"),
        ("re-sends answered duplicate by the new master", stats["duplicates"], "msgs"),
        ("lost", len(tally.missing()), "msgs"),
        ("handed out again, attempts raised (marked)", marked, "msgs"),
        ("handed out again, not marked (duplicated)", unmarked, "msgs"),
    ]


async def _replication_lag(group: ReplicatedGroup, master: ServerChild) -> int:
    """The most bytes a slave was behind ``master``, by its STATUS (-1 if it does not answer)."""
    try:
        answer = await group.status(master.address)
    except Exception:  # a figure for the report, not a condition of the run
        return -1
    replicas = (answer["statistics"].get("replication") or {}).get("replicas") or []
    return max((int(replica.get("lag_bytes") or 0) for replica in replicas), default=0)


def bench_failover(
    scratch: Path,
    *,
    count: int = 5_000,
    kill_after: float = 6.0,
    accept_count: int = 20_000,
    realtime: bool = False,
    realtime_count: int = 8_000,
    realtime_rate: float = 500.0,
) -> list[Row]:
    """``count`` messages due 2-20 s ahead, the master SIGKILLed ``kill_after`` s after the first was
    sent, then handed over at that moment instead; then the accept rate of ``accept_count`` messages
    with one sync slave and with none.

    ``realtime``: instead, ``realtime_count`` immediate messages at ``realtime_rate`` msg/s into a
    realtime group whose master is SIGKILLed ``kill_after`` s in, then handed over."""
    if realtime:
        run = partial(_realtime_failover_run, count=realtime_count, kill_after=kill_after, rate=realtime_rate)
        return [
            *trio.run(partial(run, scratch / "failover-realtime")),
            *trio.run(partial(run, scratch / "handover-realtime", handover=True)),
        ]
    rows = trio.run(_failover_run, scratch / "failover", count, kill_after)
    rows += trio.run(partial(_failover_run, scratch / "handover", count, kill_after, handover=True))
    replicated = trio.run(partial(_accept_rate, scratch / "accept-sync", accept_count, slaves=1))
    single = trio.run(partial(_accept_rate, scratch / "accept-single", accept_count, slaves=0))
    return [
        *rows,
        (f"{accept_count:,} scheduled, sync to 1 slave: accepted", replicated, "msg/s"),
        (f"{accept_count:,} scheduled, no slave: accepted", single, "msg/s"),
        ("accept rate, sync slave / no slave", 100 * replicated / single if single else 0.0, "%"),
    ]


__all__ = [
    "REALTIME_GROUP",
    "ReplicatedGroup",
    "ServerChild",
    "Tally",
    "bench_failover",
    "consume",
    "epoch_of",
    "kill_master_and_time_takeover",
    "open_replicated_group",
    "role_of",
    "send_all",
    "send_until_stored",
    "wall_ms",
]
