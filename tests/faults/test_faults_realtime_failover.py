"""A replicated realtime group of real processes: its master SIGKILLed again and again, or frozen.

A metaserver and a realtime group of three members (a master and two slaves, each its
own data folder, ``--min-insync 1``) each run as a ``delaymq`` process
(``delaymq.bench.failover.open_replicated_group``). Two producers send immediate
messages with ids the test keeps, sending a failed batch again with the same ids until
the group takes it; two consumer groups receive every message and ack it, and the test
notes when each ack was answered (``Consumer.flush`` returned True).

- Sync replication, the master SIGKILLed at a random moment, three times, each time
  started again on its own data folder (it rejoins as a slave): every acknowledged
  message reaches both groups, nothing is received by a group after its ack was
  answered, and every message a group received again came with its attempts raised.
  Before each kill a second, stuck consumer in each group takes a batch and does not
  ack it: the group hands those messages out again after the ack timeout, from the new
  master, marked.
- Async replication, a kill at a random moment and one while the slaves were stalled
  (SIGSTOP) and the master answered alone: what a group lost is no more than what the
  deposed masters, back as slaves, cut and reported (their STATUS and their logs).
- The master SIGSTOPped past ``--failover-after``: once the metaserver shows the new
  master it is woken, and the SEND and PULL waiting for it (and those sent right after)
  are refused: nothing stored there (the new master takes the same ids as new), nothing
  handed out; it rejoins as a slave, and the load loses nothing, as under the kills.

A server that dies of an error (a traceback in its log) fails a test, whatever else happened.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.bench.cluster import BODY
from delaymq.bench.failover import (
    REALTIME_GROUP,
    SUBJECT,
    ReplicatedGroup,
    ServerChild,
    Tally,
    kill_master_and_time_takeover,
    open_replicated_group,
    role_of,
    send_until_stored,
    wall_ms,
)
from delaymq.client import open_consumer, open_producer
from delaymq.client.consumer import Consumer
from delaymq.client.delivery import ReceivedMessage
from delaymq.net.connection import TransportError
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.frames import Frame
from delaymq.protocol.records import decode_batch, encode_message

pytestmark = pytest.mark.faults

FAILOVER_AFTER_MS = 2_500
#: What the metaserver's detection and the slave's take-over may add to --failover-after.
TAKEOVER_SLACK_MS = 3_000
#: A hand-out whose answer died with the old master comes back this soon (attempts raised).
ACK_TIMEOUT = "6s"
#: Each producer sends batches of this many messages every 50 ms.
BATCH = 20
PRODUCERS = 2
#: Under async replication, messages acknowledged by the master alone (its slaves stalled) before it is killed.
STALLED_FOR = BATCH * PRODUCERS * 3
CONSUMER_GROUPS = ("billing", "audit")
#: A message a stuck consumer held across a kill is handed out again within this (the ack timeout,
#: the failover, and the load of two cores).
HELD_BACK_WITHIN_S = 30
#: Codes a member that is not master answers with (both retryable; nothing stored).
REFUSED = {"not_master", "unavailable"}


@dataclass
class Receipts:
    """What one consumer group received (a ``Tally`` sharing the producers' acknowledged ids), when
    each id's ack was answered, and what a consumer held unacked across a failover."""

    name: str
    tally: Tally
    ack_answered: dict[str, int] = field(default_factory=dict)  # id -> wall ms its first ack was answered
    held: set[str] = field(default_factory=set)  # ids a consumer took before a kill and did not ack
    arrived: trio.Event = field(default_factory=trio.Event)  # set (and replaced) at each receipt

    def receive(self, message: ReceivedMessage) -> None:
        tally = self.tally
        tally.received.setdefault(message.id, []).append(message.received_at)
        tally.attempts.setdefault(message.id, []).append(message.attempts)
        tally.received_due.setdefault(message.id, message.deliver_at)
        tally.changed.set()
        self.arrived.set()
        self.arrived = trio.Event()

    def answered(self, messages: Sequence[ReceivedMessage]) -> None:
        now = wall_ms()
        for message in messages:
            self.ack_answered.setdefault(message.id, now)

    def after_ack(self) -> dict[str, tuple[int, int]]:
        """Ids received again after their ack was answered: id -> (answered at, received at)."""
        return {
            i: (self.ack_answered[i], max(times))
            for i, times in self.tally.received.items()
            if i in self.ack_answered and max(times) > self.ack_answered[i]
        }

    def held_not_again(self) -> set[str]:
        """Held ids the group has not handed out again (yet)."""
        return {i for i in self.held if len(self.tally.received[i]) < 2}


async def produce(meta: str, sent: Tally, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Batches of ``BATCH`` immediate messages every 50 ms until cancelled; a batch the group did not
    take is sent again (same ids) until it does. Only what was answered is in ``sent.acked``."""
    async with open_producer(meta, timeout=2.0) as producer:
        task_status.started()
        while True:
            await send_until_stored(producer, [producer.message(SUBJECT, BODY) for _ in range(BATCH)], sent)
            await trio.sleep(0.05)  # the producer's pace


async def ack_answered(consumer: Consumer, receipts: Receipts, messages: Sequence[ReceivedMessage]) -> None:
    """Ack ``messages`` and flush until the group answered every ack."""
    for message in messages:
        await message.ack()
    while not await consumer.flush():  # refused or unanswered (a failover): they stay queued
        await trio.sleep(0.05)  # a retry backoff, not a synchronisation
    receipts.answered(messages)


async def consume(
    meta: str, receipts: Receipts, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Receive and ack every message of ``SUBJECT`` for group ``receipts.name`` until cancelled; after
    each batch, flush the acks until the group answered them all."""
    async with open_consumer(
        meta, SUBJECT, group=receipts.name, start="earliest", pull_batch=200, max_messages_held=5_000,
        poll_timeout=1.0, request_timeout=3.0,
    ) as consumer:  # fmt: skip
        task_status.started()
        while True:
            batch = await consumer.receive_batch()
            for message in batch:
                receipts.receive(message)
            await ack_answered(consumer, receipts, batch)


async def hold_across_kill(
    meta: str, receipts: Receipts, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """A second consumer of the group, stuck: it takes one batch and does not ack it (started just
    before a kill). The group must hand those messages out again after the ack timeout, whichever
    member is master by then, with attempts raised; only then does this one ack them (too late) and go."""
    async with open_consumer(
        meta, SUBJECT, group=receipts.name, start="earliest", pull_batch=BATCH, max_messages_held=BATCH,
        poll_timeout=1.0, request_timeout=3.0,
    ) as consumer:  # fmt: skip
        batch = await consumer.receive_batch()
        for message in batch:
            receipts.receive(message)
        receipts.held.update(message.id for message in batch)
        task_status.started()
        with trio.move_on_after(HELD_BACK_WITHIN_S):  # any not back by then are reported
            while not {message.id for message in batch}.isdisjoint(receipts.held_not_again()):
                await receipts.arrived.wait()
        await ack_answered(consumer, receipts, batch)


@dataclass
class Load:
    sent: Tally
    groups: list[Receipts]
    scope: trio.CancelScope

    async def wait_all_in(self, *, timeout: float) -> None:
        """Until both groups received every acknowledged message (``trio.TooSlowError`` after ``timeout``)."""
        with trio.fail_after(timeout):
            for receipts in self.groups:
                await receipts.tally.wait_all_in(timeout=timeout)

    async def wait_held_back(self) -> None:
        """Until every message a stuck consumer held across a kill was handed out again (at most
        ``HELD_BACK_WITHIN_S``; any not back by then are reported)."""
        with trio.move_on_after(HELD_BACK_WITHIN_S):
            for receipts in self.groups:
                while receipts.held_not_again():
                    await receipts.arrived.wait()

    async def wait_more_sent(self, count: int, *, timeout: float = 20.0) -> None:
        """Until the producers got ``count`` more messages acknowledged: the group takes SENDs."""
        await self.sent.wait_acked(len(self.sent.acked) + count, timeout=timeout)


async def start_load(nursery: trio.Nursery, meta: str) -> Load:
    """Two consumer groups, then the producers, in ``nursery``; cancel ``Load.scope`` to stop the producers."""
    sent = Tally()
    groups = [Receipts(name, Tally(acked=sent.acked)) for name in CONSUMER_GROUPS]
    for receipts in groups:
        await nursery.start(consume, meta, receipts)
    scope = trio.CancelScope()

    async def producers(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            async with trio.open_nursery() as inner:
                for _ in range(PRODUCERS):
                    await inner.start(produce, meta, sent)
                task_status.started()

    await nursery.start(producers)
    return Load(sent, groups, scope)


async def finish_load(load: Load, *, timeout: float) -> None:
    """Stop the producers; wait (at most ``timeout`` s) until both groups got every acknowledged
    message. What is missing then is reported as lost."""
    load.scope.cancel()
    with trio.move_on_after(timeout):
        await load.wait_all_in(timeout=timeout)


def delivery_figures(load: Load) -> dict[str, Any]:
    """Per consumer group: lost, received again (marked with raised attempts / not), received after the ack."""
    figures: dict[str, Any] = {"messages": len(load.sent.acked), "send_retries": load.sent.send_errors}
    for receipts in load.groups:
        marked, unmarked = receipts.tally.handed_out_again()
        figures[f"{receipts.name}_lost"] = len(receipts.tally.missing())
        figures[f"{receipts.name}_remarked"] = marked
        figures[f"{receipts.name}_duplicated"] = unmarked
        figures[f"{receipts.name}_after_ack"] = len(receipts.after_ack())
        figures[f"{receipts.name}_held_across_kills"] = len(receipts.held)
    return figures


def check_sync_delivery(load: Load, *, at_least: int) -> None:
    """Sync replication: nothing acknowledged lost, nothing received after its ack was answered,
    every receipt after the first marked (``at_least`` messages acknowledged: the load ran)."""
    assert len(load.sent.acked) >= at_least
    for receipts in load.groups:
        tally = receipts.tally
        lost = tally.missing()
        assert not lost, f"{receipts.name}: {len(lost)} acknowledged message(s) never arrived, e.g. {sorted(lost)[:5]}"
        after_ack = receipts.after_ack()
        assert not after_ack, (
            f"{receipts.name}: received after the ack was answered (ms): {list(after_ack.items())[:5]}"
        )
        unmarked = {
            i: counts for i, counts in tally.attempts.items()
            if any(count <= max(counts[:n]) for n, count in enumerate(counts[1:], start=1))
        }  # fmt: skip
        assert not unmarked, f"{receipts.name}: received again, attempts not raised: {list(unmarked.items())[:5]}"
        # Handed out before a kill and not acked: handed out again after it (marked, as checked above).
        assert receipts.held, f"{receipts.name}: no consumer held a message across a kill"
        not_again = receipts.held_not_again()
        assert not not_again, (
            f"{receipts.name}: held unacked across a kill, never handed out again: {sorted(not_again)[:5]}"
        )


def epoch_of(answer: dict[str, Any]) -> int:
    """A realtime member's epoch, from its STATUS."""
    return int(answer["statistics"]["epoch"])


def lag_bytes(answer: dict[str, Any]) -> int:
    """The least a slave of this master was behind (the one the metaserver would promote), by its STATUS."""
    replicas = answer["statistics"]["replication"].get("replicas") or []
    return min((int(replica.get("lag_bytes") or 0) for replica in replicas), default=0)


@dataclass
class Round:
    takeover_ms: int
    first_send_ms: int
    first_hand_out_ms: int
    rejoin_ms: int
    epoch: int
    cut_messages: int
    cut_messages_logged: int
    lag_bytes_before: int


async def fail_over(
    group: ReplicatedGroup, master: ServerChild, *, load: Load, stalled_for: int = 0
) -> tuple[ServerChild, Round]:
    """SIGKILL ``master``; time the take-over (promotion, first SEND stored, first hand-out by the new
    master); start ``master`` again on its data folder and wait until it is an in-sync slave of the
    new one. The new master, and the figures.

    ``stalled_for``: the slaves are SIGSTOPped first until the producers got that many more messages
    acknowledged (async replication: the master answers alone), and woken right after the kill."""
    others = [member for member in group.members if member is not master]
    stalled = others if stalled_for else []
    for member in stalled:
        member.send_signal(signal.SIGSTOP)
    if stalled:  # well within --failover-after: the metaserver still counts them
        await load.wait_more_sent(stalled_for, timeout=(FAILOVER_AFTER_MS / 1000) / 2)
    before = await group.status(master.address)
    epoch_before, lag_before = epoch_of(before), lag_bytes(before)
    if stalled:
        await master.kill()  # kill_master_and_time_takeover measures from a few ms later
        for member in stalled:
            member.send_signal(signal.SIGCONT)
    takeover = await kill_master_and_time_takeover(group, master, others, ["messages_stored", "messages_delivered"])
    new_master = takeover.new_master
    epoch = epoch_of(await group.status(new_master.address))
    assert epoch > epoch_before
    restarted = wall_ms()
    rejoined = await group.start_member(master, role="slave")
    assert epoch_of(rejoined) == epoch
    await group.wait_in_sync(new_master, master)
    in_step = await group.wait_status(
        master.address,
        lambda a: role_of(a) == "slave" and a["statistics"]["replication"].get("lag_bytes") == 0,
        timeout=20,
    )
    return new_master, Round(
        takeover_ms=takeover.promoted_ms - takeover.killed_ms,
        first_send_ms=takeover.first_ms["messages_stored"] - takeover.killed_ms,
        first_hand_out_ms=takeover.first_ms["messages_delivered"] - takeover.killed_ms,
        rejoin_ms=wall_ms() - restarted,
        epoch=epoch,
        cut_messages=in_step["statistics"]["replication"]["cut_messages"],
        cut_messages_logged=0,  # filled in by the caller, who knows the member's starts
        lag_bytes_before=lag_before,
    )


def round_figures(rounds: Sequence[Round]) -> dict[str, Any]:
    return {
        "kills": len(rounds),
        "max_takeover_ms": max(r.takeover_ms for r in rounds),
        "max_first_send_ms": max(r.first_send_ms for r in rounds),
        "max_first_hand_out_ms": max(r.first_hand_out_ms for r in rounds),
        "max_rejoin_ms": max(r.rejoin_ms for r in rounds),
        "epochs": " < ".join(str(r.epoch) for r in rounds),
        "cut_messages": sum(r.cut_messages for r in rounds),
    }


async def hold_in_every_group(nursery: trio.Nursery, meta: str, load: Load) -> None:
    """Start a stuck consumer (``hold_across_kill``) in each consumer group; returns once each holds a batch."""
    for receipts in load.groups:
        await nursery.start(hold_across_kill, meta, receipts)


async def kill_rounds(
    group: ReplicatedGroup,
    load: Load,
    rng: random.Random,
    cut_in_log: Any,
    *,
    stalled_for: Sequence[int],
    holders: trio.Nursery | None = None,
) -> list[Round]:
    """Once per item of ``stalled_for``: let the load run a random while, then SIGKILL the master (its
    slaves stalled while that many messages were acknowledged, if not 0) and bring it back. With
    ``holders``, a stuck consumer in every group holds a batch unacked across each kill."""
    master = group.members[0]
    rounds = []
    for stalled in stalled_for:
        await load.wait_more_sent(BATCH * PRODUCERS * 5)  # the group takes SENDs again
        await trio.sleep(rng.uniform(0.5, 2.5))  # a random moment under load: a schedule, not a wait
        if holders is not None:
            await hold_in_every_group(holders, group.meta.address, load)
        killed, starts = master, master.starts
        master, figures = await fail_over(group, master, load=load, stalled_for=stalled)
        figures.cut_messages_logged = cut_in_log(killed, starts + 1, unit="message")
        rounds.append(figures)
    return rounds


async def test_sync_a_master_sigkilled_three_times_loses_nothing_acked_and_marks_every_hand_out_again(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any, cut_in_log: Any
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    with servers_must_not_crash(tmp_path), trio.fail_after(100):
        async with open_replicated_group(
            tmp_path, kind="realtime", failover_after_ms=FAILOVER_AFTER_MS, slaves=2, min_insync=1,
            replication="sync", member_options=["--ack-timeout", ACK_TIMEOUT],
        ) as group:  # fmt: skip
            async with trio.open_nursery() as nursery:
                load = await start_load(nursery, group.meta.address)
                rounds = await kill_rounds(group, load, rng, cut_in_log, stalled_for=[0, 0, 0], holders=nursery)
                await load.wait_held_back()
                await load.wait_more_sent(BATCH * PRODUCERS * 5)
                await finish_load(load, timeout=30)
                nursery.cancel_scope.cancel()
    fault_report.record(seed=seed, **round_figures(rounds), **delivery_figures(load))
    check_sync_delivery(load, at_least=2_000)
    for figures in rounds:
        assert figures.takeover_ms <= FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS
        assert figures.cut_messages == figures.cut_messages_logged  # a cut is counted as it is logged
    assert [r.epoch for r in rounds] == sorted({r.epoch for r in rounds})  # strictly increasing


async def test_async_a_sigkilled_master_loses_at_most_what_it_cut_and_says_so(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any, cut_in_log: Any
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    with servers_must_not_crash(tmp_path), trio.fail_after(80):
        async with open_replicated_group(
            tmp_path, kind="realtime", failover_after_ms=FAILOVER_AFTER_MS, slaves=2, min_insync=1,
            replication="async", member_options=["--ack-timeout", ACK_TIMEOUT],
        ) as group:  # fmt: skip
            async with trio.open_nursery() as nursery:
                load = await start_load(nursery, group.meta.address)
                # A kill at a random moment, then one while the slaves were stalled: acknowledged messages
                # only the master held, lost with it.
                rounds = await kill_rounds(group, load, rng, cut_in_log, stalled_for=[0, STALLED_FOR])
                await load.wait_more_sent(BATCH * PRODUCERS * 5)
                await finish_load(load, timeout=20)
                nursery.cancel_scope.cancel()
    cut = sum(r.cut_messages for r in rounds)
    fault_report.record(
        seed=seed,
        lag_bytes_before_kills=" ".join(str(r.lag_bytes_before) for r in rounds),
        **round_figures(rounds),
        **delivery_figures(load),
    )
    assert len(load.sent.acked) > 500
    assert rounds[1].lag_bytes_before > 0  # the master's STATUS showed what its slaves did not hold
    for figures in rounds:
        assert figures.takeover_ms <= FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS
        # What the deposed master cut is counted in its STATUS as it is logged.
        assert figures.cut_messages == figures.cut_messages_logged
    for receipts in load.groups:
        lost = receipts.tally.missing()
        assert len(lost) <= cut, (
            f"{receipts.name}: {len(lost)} acknowledged message(s) lost, but the deposed masters reported "
            f"{cut} cut: e.g. {sorted(lost)[:5]}"
        )


def send_body(names: Sequence[str]) -> bytes:
    """A SEND's body: one immediate message of ``SUBJECT`` per id."""
    return b"".join(encode_message(name, SUBJECT, body=BODY, created_at=wall_ms()) for name in names)


def describe_answer(answer: Frame | PeerError | TransportError) -> str:
    """A raw call's outcome for the report: the refusal's code, "no answer", or "answered"."""
    if isinstance(answer, PeerError):
        return str(answer.code)
    return "no answer" if isinstance(answer, TransportError) else "answered"


async def test_a_master_frozen_past_failover_after_neither_stores_nor_hands_out_when_it_wakes(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    answers: dict[str, Frame | PeerError | TransportError] = {}
    with servers_must_not_crash(tmp_path), trio.fail_after(80):
        async with open_replicated_group(
            tmp_path, kind="realtime", failover_after_ms=FAILOVER_AFTER_MS, slaves=2, min_insync=1,
            replication="sync", member_options=["--ack-timeout", ACK_TIMEOUT],
        ) as group:  # fmt: skip
            master, *slaves = group.members
            meta = group.meta.address
            async with trio.open_nursery() as nursery, open_peers(request_timeout=10.0) as raw:
                load = await start_load(nursery, meta)
                await load.wait_more_sent(BATCH * PRODUCERS * 5)
                await trio.sleep(rng.uniform(0.5, 2.5))  # a random moment under load: a schedule, not a wait
                await hold_in_every_group(nursery, meta, load)
                epoch_before = epoch_of(await group.status(master.address))
                frozen = wall_ms()
                master.send_signal(signal.SIGSTOP)

                def new_masters(answer: dict[str, Any]) -> list[str]:
                    """The group's master as the metaserver's STATUS shows it, if not the frozen one."""
                    return [
                        row["address"] for row in answer["rows"]
                        if row["group"] == REALTIME_GROUP and row["role"] == "master" and row["address"] != master.address
                    ]  # fmt: skip

                promoted_at = await group.wait_status(
                    meta,
                    lambda a: bool(new_masters(a)),
                    timeout=(FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS) / 1000 + 10,
                    poll=0.02,
                )
                failover_ms = wall_ms() - frozen
                (new_address,) = new_masters(promoted_at)
                assert new_address in {slave.address for slave in slaves}
                promoted = await group.wait_status(new_address, lambda a: role_of(a) == "master", timeout=10)
                assert epoch_of(promoted) > epoch_before

                async def ask(name: str, command: int, metadata: dict[str, Any], body: bytes = b"") -> None:
                    try:
                        answers[name] = await raw.call(master.address, command, metadata, body, timeout=10.0)
                    except (PeerError, TransportError) as error:
                        answers[name] = error

                pull = {"group": "woken-check", "consumer": "c1", "subject": SUBJECT, "max": 100, "timeout_ms": 0,
                        "from": "earliest"}  # fmt: skip
                async with trio.open_nursery() as asking:
                    # Requests waiting in its sockets when it wakes, then requests sent once it is awake.
                    asking.start_soon(ask, "send_waiting", Command.SEND, {}, send_body(["woken-1", "woken-2"]))
                    asking.start_soon(ask, "pull_waiting", Command.PULL, pull)
                    await trio.sleep(0.3)  # the requests on their way into its sockets: a schedule, not a wait
                    master.send_signal(signal.SIGCONT)
                    woken = wall_ms()
                    asking.start_soon(ask, "send_woken", Command.SEND, {}, send_body(["woken-3"]))
                    asking.start_soon(ask, "pull_woken", Command.PULL, {**pull, "consumer": "c2"})
                # The ids it was asked to store are new to the new master: the woken one stored none of them.
                stored = await raw.call(new_address, Command.SEND, {}, send_body(["woken-1", "woken-2", "woken-3"]))
                rejoined = await group.wait_status(
                    master.address, lambda a: role_of(a) == "slave" and epoch_of(a) == epoch_of(promoted), timeout=20
                )
                rejoin_ms = wall_ms() - woken
                await load.wait_more_sent(BATCH * PRODUCERS * 5)
                await load.wait_held_back()
                await finish_load(load, timeout=30)
                in_step = await group.wait_status(
                    master.address, lambda a: a["statistics"]["replication"].get("lag_bytes") == 0, timeout=20
                )
                nursery.cancel_scope.cancel()
    fault_report.record(
        seed=seed,
        failover_ms=failover_ms,
        rejoin_after_wake_ms=rejoin_ms,
        cut_messages=in_step["statistics"]["replication"]["cut_messages"],
        **{name: describe_answer(answer) for name, answer in answers.items()},
        **delivery_figures(load),
    )
    assert failover_ms <= FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS
    for name in ("send_waiting", "send_woken"):
        answer = answers[name]
        assert isinstance(answer, PeerError) and answer.code in REFUSED, (
            f"{name}: the woken deposed master answered {answer!r}"
            + ("" if isinstance(answer, PeerError) else f" {answer.metadata}")
        )
    for name in ("pull_waiting", "pull_woken"):
        answer = answers[name]  # refused, no answer, or an empty one
        handed = decode_batch(answer.body) if isinstance(answer, Frame) else []
        assert not handed, f"{name}: the woken deposed master handed out {[m.id for m in handed][:5]}"
        assert not isinstance(answer, PeerError) or answer.code in REFUSED, answer
    assert stored.metadata["results"] == ["stored"] * 3
    assert role_of(rejoined) == "slave"
    check_sync_delivery(load, at_least=500)
