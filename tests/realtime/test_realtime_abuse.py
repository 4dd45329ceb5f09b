"""What a token holder cannot do to a realtime server: set a fence epoch far in the future, read a
realtime group's message log as another server, run the server out of file descriptors or files
with new subjects and group names, or have another tenant's message dropped as a duplicate.

Each test runs a real realtime server on loopback with a tokens file, on a ``TrioClock`` over
trio's own clock, and looks at what the caller is told and at what the server holds afterwards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.clock import SystemClock, TrioClock
from delaymq.net.auth import FORBIDDEN, TokenFile
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.fencing import Fence
from delaymq.protocol.frames import Frame
from delaymq.protocol.records import Message, decode_batch, encode_batch
from delaymq.realtime import RealtimeServer, open_realtime_server
from delaymq.realtime import dedup as dedup_store
from delaymq.realtime.caps import OVER_LOG_INTERVAL_MS, SubjectCap
from delaymq.realtime.consumelog import OPEN_CONSUME_LOGS, ConsumeLog, encode_entry
from delaymq.realtime.fences import MAX_EPOCH_AHEAD_MS
from delaymq.realtime.openfiles import OpenFiles
from delaymq.replication.wire import FetchRequest
from delaymq.scheduler.server import Scheduler
from delaymq.storage.state import StateStore
from delaymq.storage.threads import run_inline

from ..conftest import open_local_servers
from ..support.tokens import ADMIN as ADMIN  # test_realtime_clear_fence's import
from ..support.tokens import CONSUMER, OPS_TOKEN, PRODUCER, SERVER, SERVERS_TOKEN, SHOP_TOKEN, token, tokens_toml

EPOCH = 1_700_000_000_000
DAY_MS = 86_400_000
WAIT = 30.0

SCHEDULER = "sched-1-secret-0123456789"
OTHER_REALTIME = "rt-other-secret-0123456789"
TENANT_A = "tenant-a-secret-0123456789"
TENANT_B = "tenant-b-secret-0123456789"

TOKENS = tokens_toml(
    SERVERS_TOKEN,
    token("sched-1", SCHEDULER, ["server"], servers=["scheduler:sched-1"]),
    token("rt-other", OTHER_REALTIME, ["server"], servers=["realtime:rt-other"]),
    SHOP_TOKEN,
    token("tenant-a", TENANT_A, ["producer", "consumer"], subjects=["a.*"], groups=["a-*"]),
    token("tenant-b", TENANT_B, ["producer", "consumer"], subjects=["b.*"], groups=["b-*"]),
    token("team", CONSUMER, ["consumer"], groups=["team-*"]),
    OPS_TOKEN,
)


@dataclass
class Secured:
    """A realtime server with a tokens file, and calls to it as any token."""

    server: RealtimeServer
    data: Path

    async def call(
        self, token: str | None, command: int, metadata: dict[str, Any] | None = None, body: bytes = b""
    ) -> Frame:
        async with open_peers(limits=Limits(token=token)) as peers:
            return await peers.call(self.server.address, command, metadata or {}, body, timeout=WAIT)

    async def refused(
        self, token: str | None, command: int, metadata: dict[str, Any] | None = None, body: bytes = b""
    ) -> PeerError:
        with pytest.raises(PeerError) as caught:
            await self.call(token, command, metadata, body)
        return caught.value

    async def send(self, token: str, messages: list[Message], **metadata: Any) -> list[str]:
        frame = await self.call(token, Command.SEND, metadata, encode_batch(messages))
        results: list[str] = frame.metadata["results"]
        return results

    async def pull(self, token: str, subject: str, group: str, **options: Any) -> list[Message]:
        metadata = {"group": group, "consumer": "c", "subject": subject, "max": 100, "from": "earliest", **options}
        frame = await self.call(token, Command.PULL, metadata)
        return decode_batch(frame.body) if frame.body else []

    async def status(self) -> dict[str, Any]:
        return (await self.call(SERVER, Command.STATUS)).metadata


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return path


@asynccontextmanager
async def open_secured(tmp_path: Path, tokens: Path, **options: Any) -> AsyncIterator[Secured]:
    """The server on ``tmp_path/rt`` (open it again to restart it)."""
    limits = Limits(tokens=TokenFile(tokens), token=SERVER)
    data = tmp_path / "rt"
    options.setdefault("run_blocking", run_inline)  # the TrioClock is read in the event loop only
    async with open_realtime_server(
        data_dir=data, clock=TrioClock(EPOCH), listen="127.0.0.1:0", limits=limits, **options
    ) as server:
        yield Secured(server, data)


@asynccontextmanager
async def open_cluster(tmp_path: Path, tokens: Path, **options: Any) -> AsyncIterator[tuple[Secured, Scheduler]]:
    """A metaserver, the realtime server (with ``options``) and a scheduler on loopback, on the real
    clock, each with the tokens file; yielded once both servers have registered."""
    limits = Limits(tokens=TokenFile(tokens), token=SERVER)
    async with open_local_servers(tmp_path, limits, wait=WAIT, **options) as servers:
        yield Secured(servers.realtime, tmp_path / "rt"), servers.scheduler


def message(message_id: str, subject: str, body: bytes = b"body") -> Message:
    return Message(message_id, subject, body=body)


def pull_metadata(group: str, subject: str, **options: Any) -> dict[str, Any]:
    return {"group": group, "consumer": "c", "subject": subject, "max": 1, "timeout_ms": 0, **options}


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def files(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


# ------------------------------------------------------------------ fences


async def test_a_fence_epoch_more_than_a_day_ahead_is_refused_and_stores_nothing(tmp_path: Path, tokens: Path) -> None:
    async with open_secured(tmp_path, tokens) as rt:
        now = rt.server.member.clock.now_ms()
        ahead = Fence("sched-1", now + 2 * DAY_MS)
        error = await rt.refused(SCHEDULER, Command.SEND, ahead.as_metadata(), encode_batch([message("x1", "o")]))
        assert (error.code, error.field, error.limit) == ("limit", "fence.epoch", MAX_EPOCH_AHEAD_MS)
        assert "'sched-1'" in error.message and "86400000 ms (1 day)" in error.message
        status = await rt.status()
        assert status["fences"] == {}
        assert status["statistics"]["messages_stored"] == 0 and status["statistics"]["message_log_end"] == 0
        # An epoch as the metaserver makes them (its clock's now, or one more than the last) passes.
        minted = Fence("sched-1", now)
        assert await rt.send(SCHEDULER, [message("x2", "o")], **minted.as_metadata()) == ["stored"]
        assert (await rt.status())["fences"] == {"sched-1": minted.epoch}
    async with open_secured(tmp_path, tokens) as rt:  # nothing of the refused one was written either
        assert (await rt.status())["fences"] == {"sched-1": minted.epoch}


# ------------------------------------------------------------------ FETCH


async def test_fetch_of_a_realtime_groups_log_needs_a_token_bound_to_that_group(tmp_path: Path, tokens: Path) -> None:
    limits = Limits(tokens=TokenFile(tokens), token=SERVER)
    async with open_local_servers(tmp_path, limits, wait=WAIT) as servers:
        rt: RealtimeServer = servers.realtime
        secured = Secured(rt, tmp_path / "rt")
        assert await secured.send(PRODUCER, [message("secret-1", "payroll", b"salary: 1,000,000")]) == ["stored"]
        fetch = FetchRequest(group=rt.group, address="127.0.0.1:9", epoch=rt.epoch, offset=0, last_epoch=0)
        for token in (OTHER_REALTIME, SCHEDULER):  # a server token, of another group or kind
            error = await secured.refused(token, Command.FETCH, fetch.as_metadata())
            assert (error.code, error.field) == (FORBIDDEN, "servers")
            assert f"may not act as server realtime:{rt.group}" in error.message
        error = await secured.refused(CONSUMER, Command.FETCH, fetch.as_metadata())
        assert error.code == FORBIDDEN and "role server needed" in error.message
        # The group's own servers' token reads it.
        frame = await secured.call(SERVER, Command.FETCH, fetch.as_metadata())
        assert b"salary: 1,000,000" in frame.body


# ------------------------------------------------------------------ descriptors and caps


async def test_many_subjects_hold_a_bounded_number_of_descriptors_and_keep_working(
    tmp_path: Path, tokens: Path
) -> None:
    async with open_secured(tmp_path, tokens) as rt:
        assert await rt.send(PRODUCER, [message("warm-up", "s.warm")]) == ["stored"]
        before = open_descriptors()
        batch = [message(f"m{n}", f"s.{n}") for n in range(3_000)]
        assert await rt.send(PRODUCER, batch) == ["stored"] * 3_000
        assert (await rt.status())["statistics"]["subjects"] == 3_001
        assert open_descriptors() - before <= OPEN_CONSUME_LOGS + 16  # not one per subject
        # A subject whose descriptor was closed is read and written as before.
        assert [m.id for m in await rt.pull(CONSUMER, "s.0", "team-x")] == ["m0"]
        assert await rt.send(PRODUCER, [message("m0-again", "s.0")]) == ["stored"]
        assert [m.id for m in await rt.pull(CONSUMER, "s.0", "team-x")] == ["m0-again"]
        assert open_descriptors() - before <= OPEN_CONSUME_LOGS + 16


async def test_a_send_past_the_subject_cap_is_refused_whole(tmp_path: Path, tokens: Path) -> None:
    async with open_secured(tmp_path, tokens, max_subjects=5) as rt:
        assert await rt.send(PRODUCER, [message(f"a{n}", f"s.{n}") for n in range(4)]) == ["stored"] * 4
        log_end = (await rt.status())["statistics"]["message_log_end"]
        consume_files = files(rt.data / "consume")
        batch = [message("b0", "s.0"), message("b4", "s.4"), message("b5", "s.5"), message("b6", "s.6")]
        error = await rt.refused(PRODUCER, Command.SEND, {}, encode_batch(batch))
        assert (error.code, error.field, error.limit, error.index) == ("limit", "subject", 5, 2)
        assert "SEND: subject 's.5' would be subject number 6 on this server (--max-subjects 5)" in error.message
        status = await rt.status()
        assert status["statistics"]["message_log_end"] == log_end  # nothing of the batch, not even b0
        assert status["statistics"]["subjects"] == 4 and files(rt.data / "consume") == consume_files
        # At the cap: what exists keeps working, one more new subject does not fit.
        assert await rt.send(PRODUCER, [message("c0", "s.0"), message("c4", "s.4")]) == ["stored"] * 2
        assert (await rt.refused(PRODUCER, Command.SEND, {}, encode_batch([message("d", "s.9")]))).limit == 5
        consume_files = files(rt.data / "consume")
    async with open_secured(tmp_path, tokens, max_subjects=5) as rt:  # counted again at start-up
        error = await rt.refused(PRODUCER, Command.SEND, {}, encode_batch([message("e5", "s.5"), message("e6", "s.6")]))
        assert "'s.5' would be subject number 6" in error.message  # s.4 came in at the cap
        assert files(rt.data / "consume") == consume_files


async def test_pulls_past_the_group_cap_are_refused_and_make_no_files(tmp_path: Path, tokens: Path) -> None:
    async with open_secured(tmp_path, tokens, max_groups=10) as rt:
        assert await rt.send(PRODUCER, [message("m1", "orders")]) == ["stored"]
        for n in range(10):
            assert [m.id for m in await rt.pull(CONSUMER, "orders", f"team-{n}")] == ["m1"]
        pull_files = files(rt.data / "pull")
        for n in range(10, 300):  # as many new group names as a caller likes
            metadata = {"group": f"team-{n}", "consumer": "c", "subject": "orders", "max": 1}
            error = await rt.refused(CONSUMER, Command.PULL, metadata)
            assert (error.code, error.field, error.limit) == ("limit", "group", 10)
        assert "consumer group 'team-299' reading subject 'orders' would be group number 11" in error.message
        assert "(--max-groups 10" in error.message
        assert files(rt.data / "pull") == pull_files
        assert await rt.send(PRODUCER, [message("m2", "orders")]) == ["stored"]
        assert [m.id for m in await rt.pull(CONSUMER, "orders", "team-3")] == ["m2"]  # groups there keep working
    async with open_secured(tmp_path, tokens, max_groups=10) as rt:  # counted again at start-up
        error = await rt.refused(
            CONSUMER, Command.PULL, {"group": "team-x", "consumer": "c", "subject": "orders", "max": 1}
        )
        assert error.limit == 10 and files(rt.data / "pull") == pull_files


async def test_a_groups_retry_and_dead_letter_subjects_pass_the_subject_cap_and_do_not_count(
    tmp_path: Path, tokens: Path
) -> None:
    retry, dead = "%retry%team-x%orders", "%dead%team-x%orders"
    async with open_secured(tmp_path, tokens, max_subjects=2) as rt:
        assert await rt.send(PRODUCER, [message("m1", "orders")]) == ["stored"]
        assert [m.id for m in await rt.pull(CONSUMER, "orders", "team-x")] == ["m1"]
        # Where a server puts what team-x nacks (a scheduler's, or its own appends): not counted.
        assert await rt.send(SERVER, [message("r1", retry), message("d1", dead)]) == ["stored"] * 2
        assert await rt.send(PRODUCER, [message("m2", "s.2")]) == ["stored"]  # subject number 2
        error = await rt.refused(PRODUCER, Command.SEND, {}, encode_batch([message("m3", "s.3")]))
        assert "subject 's.3' would be subject number 3 on this server (--max-subjects 2)" in error.message
        # A group that does not read the base subject, or a group's retries of its own retry
        # subject (a chain), get no such place.
        for subject in ("%retry%team-y%orders", "%dead%team-x%%retry%team-x%orders"):
            error = await rt.refused(SERVER, Command.SEND, {}, encode_batch([message("x", subject)]))
            assert (error.code, error.field, error.limit) == ("limit", "subject", 2)
        assert (await rt.status())["statistics"]["subjects"] == 4
        assert [m.id for m in await rt.pull(CONSUMER, retry, "team-x")] == ["r1"]
        assert [m.id for m in await rt.pull(CONSUMER, dead, "team-x")] == ["d1"]
    async with open_secured(tmp_path, tokens, max_subjects=2) as rt:  # counted alike at start-up
        assert await rt.send(SERVER, [message("r2", retry)]) == ["stored"]
        error = await rt.refused(PRODUCER, Command.SEND, {}, encode_batch([message("m3", "s.3")]))
        assert "'s.3' would be subject number 3" in error.message


async def test_a_schedulers_send_passes_the_subject_cap_counted_and_logged(
    tmp_path: Path, tokens: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_secured(tmp_path, tokens, max_subjects=1) as rt:
        assert await rt.send(PRODUCER, [message("m1", "orders")]) == ["stored"]
        fence = Fence("sched-1", rt.server.member.clock.now_ms()).as_metadata()
        with caplog.at_level(logging.WARNING, logger="delaymq.realtime.caps"):
            # Messages the scheduler accepted (a SCHEDULE to a new subject) fall due: stored.
            assert await rt.send(SCHEDULER, [message("s1", "reminders")], **fence) == ["stored"]
            batch = [message("s2", "invoices"), message("s3", "orders"), message("s4", "invoices")]
            assert await rt.send(SCHEDULER, batch, **fence) == ["stored"] * 3
        lines = [record.getMessage() for record in caplog.records if "over --max-subjects" in record.getMessage()]
        assert len(lines) == 1  # at most once a minute
        assert "scheduler group 'sched-1' stored subject 'reminders' over --max-subjects 1" in lines[0]
        statistics = (await rt.status())["statistics"]
        assert (statistics["subjects_over_cap"], statistics["subjects"]) == (2, 3)
        # A producer's SEND to a new subject is refused still; a fence with a stale epoch too.
        error = await rt.refused(PRODUCER, Command.SEND, {}, encode_batch([message("p1", "news")]))
        assert "'news' would be subject number 4 on this server (--max-subjects 1)" in error.message
        stale = Fence("sched-1", fence["fence"]["epoch"] - 1).as_metadata()
        error = await rt.refused(SCHEDULER, Command.SEND, stale, encode_batch([message("s5", "alerts")]))
        assert error.code == "fenced" and (await rt.status())["statistics"]["subjects_over_cap"] == 2
        assert [m.id for m in await rt.pull(CONSUMER, "invoices", "team-x")] == ["s2", "s4"]


def test_subjects_over_the_cap_are_logged_once_a_minute_with_the_count_since(caplog: pytest.LogCaptureFixture) -> None:
    class Index:
        logs: dict[str, Any] = {"orders": None}

        def subjects_coming(self) -> set[str]:
            return set()

    class Clock:
        now = 0

        def monotonic_ms(self) -> int:
            return self.now

    clock = Clock()
    cap = SubjectCap(1, Index(), {}, clock)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="delaymq.realtime.caps"):
        for now, subjects in ((0, ["a", "b"]), (OVER_LOG_INTERVAL_MS - 1, ["c"]), (OVER_LOG_INTERVAL_MS, ["d"])):
            clock.now = now
            assert cap.admit(subjects, fenced_by="sched-1") == subjects
            cap.settle(subjects)  # never indexed here: each counts as new again
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and cap.over == 4
    assert "subject 'a' over --max-subjects 1 (3 subjects now; 2 made over the cap since the last" in lines[0]
    assert "subject 'd' over --max-subjects 1 (2 subjects now; 2 made over the cap since the last" in lines[1]
    assert lines[1].endswith(
        "4 since start): messages a scheduler accepted are never refused; raise the cap or clean up"
    )


async def test_at_the_caps_a_delayed_retry_and_a_scheduled_message_to_a_new_subject_arrive(
    tmp_path: Path, tokens: Path
) -> None:
    async with open_cluster(tmp_path, tokens, max_subjects=1, max_groups=1) as (rt, scheduler):
        assert await rt.send(PRODUCER, [message("m1", "orders")]) == ["stored"]
        metadata = pull_metadata("team-x", "orders", **{"from": "earliest"})
        start = (await rt.call(CONSUMER, Command.PULL, metadata)).metadata["pull_start"]
        nack = {"group": "team-x", "consumer": "c", "subject": "orders", "start": start, "end": start + 1}
        await rt.call(CONSUMER, Command.NACK, {**nack, "delay_ms": 300})
        # The scheduler sends the retry back when due, to a subject and a share past both caps.
        [retry] = await rt.pull(CONSUMER, "%retry%team-x%orders", "team-x", timeout_ms=20_000)
        assert (retry.id, retry.attempts) == ("m1", 1)
        # A producer's SCHEDULE to a new subject: accepted by the scheduler, delivered past the cap.
        now = SystemClock().now_ms()
        scheduled = Message("s1", "reminders", body=b"later", deliver_at=now + 300, created_at=now)
        async with open_peers(limits=Limits(token=PRODUCER)) as peers:
            frame = await peers.call(scheduler.address, Command.SCHEDULE, {}, encode_batch([scheduled]), timeout=WAIT)
        assert frame.metadata["results"] == ["scheduled"]
        # Counted over the cap when stored, a subject when indexed: wait for both.
        with trio.move_on_after(WAIT):
            while (statistics := (await rt.status())["statistics"])["subjects"] < 3:
                await trio.sleep(0.05)
        assert (statistics["subjects"], statistics["subjects_over_cap"]) == (3, 1)  # the retry subject not over


async def test_a_group_at_the_group_cap_reads_its_own_retry_and_dead_letter_subjects(
    tmp_path: Path, tokens: Path
) -> None:
    retry, dead = "%retry%team-a%orders", "%dead%team-a%orders"
    async with open_secured(tmp_path, tokens, max_groups=2) as rt:
        assert await rt.send(PRODUCER, [message("m1", "orders")]) == ["stored"]
        assert await rt.send(SERVER, [message("r1", retry), message("d1", dead)]) == ["stored"] * 2
        assert [m.id for m in await rt.pull(CONSUMER, "orders", "team-a")] == ["m1"]
        assert [m.id for m in await rt.pull(CONSUMER, retry, "team-a")] == ["r1"]
        assert [m.id for m in await rt.pull(CONSUMER, dead, "team-a")] == ["d1"]
        # Not counted: a second group fits, a third does not.
        assert [m.id for m in await rt.pull(CONSUMER, "orders", "team-b")] == ["m1"]
        error = await rt.refused(CONSUMER, Command.PULL, pull_metadata("team-c", "orders"))
        assert "consumer group 'team-c' reading subject 'orders' would be group number 3" in error.message
        # At the cap, team-b's retries fit; another group's, a subject team-a does not read, or a
        # broadcast consumer (its own share each) do not.
        assert await rt.pull(CONSUMER, "%retry%team-b%orders", "team-b", timeout_ms=0) == []
        for metadata in (
            pull_metadata("team-c", "%retry%team-c%orders"),
            pull_metadata("team-a", "%retry%team-a%other"),
            pull_metadata("team-a", retry, broadcast=True, consumer="b"),
        ):
            error = await rt.refused(CONSUMER, Command.PULL, metadata)
            assert (error.code, error.field, error.limit) == ("limit", "group", 2)
    async with open_secured(tmp_path, tokens, max_groups=2) as rt:  # counted alike at start-up
        assert await rt.pull(CONSUMER, "%dead%team-b%orders", "team-b", timeout_ms=0) == []
        error = await rt.refused(CONSUMER, Command.PULL, pull_metadata("team-c", "orders"))
        assert "would be group number 3" in error.message


# ------------------------------------------------------------------ dedup per subject


async def test_an_id_known_from_another_tenant_does_not_make_its_message_a_duplicate(
    tmp_path: Path, tokens: Path
) -> None:
    victim_id = "0190f0c2-6a1b-7c3d-8e4f-a0b1c2d3e4f5"
    async with open_secured(tmp_path, tokens) as rt:
        assert await rt.send(TENANT_B, [message(victim_id, "b.noise", b"attacker")]) == ["stored"]
        assert await rt.send(TENANT_A, [message(victim_id, "a.orders", b"order 1")]) == ["stored"]
        assert await rt.send(TENANT_A, [message(victim_id, "a.orders", b"order 1")]) == ["duplicate"]
        [received] = await rt.pull(TENANT_A, "a.orders", "a-billing")
        assert (received.id, received.body) == (victim_id, b"order 1")
    # Restarted after its last checkpoint: the window is read back from lmdb (no log to replay).
    async with open_secured(tmp_path, tokens) as rt:
        second = "0190f0c2-6a1b-7c3d-8e4f-000000000002"
        assert await rt.send(TENANT_B, [message(second, "b.noise")]) == ["stored"]
        assert await rt.send(TENANT_A, [message(second, "a.orders"), message(victim_id, "a.orders")]) == [
            "stored",
            "duplicate",
        ]


@pytest.mark.parametrize("memory_ids", [100_000, 1], ids=["in-memory", "in-lmdb"])
async def test_a_resend_across_the_upgrade_to_per_subject_keys_is_a_duplicate(
    tmp_path: Path, tokens: Path, memory_ids: int
) -> None:
    async with open_secured(tmp_path, tokens, dedup_memory_ids=memory_ids) as rt:
        assert await rt.send(PRODUCER, [message("new-1", "orders")]) == ["stored"]
        now = rt.server.member.clock.now_ms()
    # Rows as the version before wrote them: a first delivery keyed by its bare id.
    store = StateStore.open(rt.data / "state", extra_format={"realtime_state": 1})
    try:
        with store.write() as batch:
            dedup_store.write_ids(batch, [(["old-1", "old-2"], now - 5_000)])
    finally:
        store.close()
    async with open_secured(tmp_path, tokens, dedup_memory_ids=memory_ids) as rt:
        batch = [message("old-1", "orders"), message("old-3", "orders"), message("old-2", "other")]
        assert await rt.send(PRODUCER, batch) == ["duplicate", "stored", "duplicate"]
        assert await rt.send(PRODUCER, [message("old-1", "orders"), message("new-1", "orders")]) == ["duplicate"] * 2
        assert (await rt.status())["statistics"]["messages_stored"] == 1


def test_consume_logs_past_the_bound_close_and_are_read_written_and_fsynced_as_before(tmp_path: Path) -> None:
    """The bound itself, without a server: what the index, PULL's reads and checkpoints do to a
    log whose descriptor the least-recently-used bound has closed."""
    bound = OpenFiles(2)
    logs = [ConsumeLog.open(tmp_path, f"s.{n}", files=bound) for n in range(3)]
    for n, log in enumerate(logs):
        log.add(n * 100, 100, 0, 7)
        log.write_pending()
    assert len(bound) == 2 and logs[0]._fd == -1  # the least recently written closed
    assert logs[0].read(0, 1) == encode_entry(0, 100, 0, 7)  # a worker thread's read, by path
    assert logs[0].entry(0).offset == 0
    assert logs[0].flush() is True  # created: its name file and folder want an fsync too
    logs[0].add(1000, 100, 0, 8)
    logs[0].write_pending()  # opened again, and another one closed
    assert logs[0]._fd >= 0 and len(bound) == 2 and logs[1]._fd == -1
    for log in logs:
        log.close()
    assert len(bound) == 0
    again = ConsumeLog.open(tmp_path, "s.0", checkpoint_count=2)
    assert again.read(0, 2) == encode_entry(0, 100, 0, 7) + encode_entry(1000, 100, 0, 8)
    again.close()
