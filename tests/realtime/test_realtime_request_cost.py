"""Per-request cost of the realtime server: no blocking file read on the event loop, few system calls.

A NACK of entries the consume log no longer holds in memory reads them in a worker
thread (``run_blocking``), as a PULL that lags does. A consumer's pull log keeps its
descriptor open between PULLs, within a bound across the server (``OPEN_PULL_LOGS``):
the least recently written is closed and opened again when its consumer comes back. A
consume log written after its indexer closed (a master stepped down with a SEND's append in
flight) opens and closes its file for the write.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from delaymq.protocol.commands import Command
from delaymq.realtime import consumelog, pulllog
from delaymq.realtime.consumelog import TAIL_ENTRIES, ConsumeLog, encode_entry
from delaymq.realtime.consumers import consumer_key
from delaymq.realtime.index import Indexer
from delaymq.realtime.pulllog import (
    OPEN_PULL_LOGS,
    PULL_ENTRY_SIZE,
    OpenPullLogs,
    PullLog,
    encode_pull_entries,
)
from delaymq.storage.threads import run_inline

T = TypeVar("T")


class WatchedBlocking:
    """``run_inline`` that knows whether a blocking call is running, and records their names."""

    def __init__(self) -> None:
        self.inside = False
        self.calls: list[str] = []

    async def __call__(self, function: Callable[[], T]) -> T:
        target = function.func if isinstance(function, partial) else function
        self.calls.append(getattr(target, "__qualname__", repr(target)))
        self.inside = True
        try:
            return await run_inline(function)
        finally:
            self.inside = False


class WatchedOs:
    """The ``os`` module as one module sees it, recording the calls named in ``watched``."""

    def __init__(self, watched: tuple[str, ...], on_call: Callable[[str, tuple[Any, ...]], None]) -> None:
        self._watched = watched
        self._on_call = on_call

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in self._watched:
            return real

        def call(*args: Any) -> Any:
            self._on_call(name, args)
            return real(*args)

        return call


def open_pull_log_fds(pull_dir: Path) -> int:
    """Descriptors of this process open on files of ``pull_dir``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{pull_dir}/"):
            count += 1
    return count


# ----------------------------------------------------------------- NACK


async def test_a_nack_of_entries_no_longer_in_memory_reads_them_in_a_worker_thread(
    local: Any, rt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    blocking = WatchedBlocking()
    preads_on_loop: list[int] = []
    preads = []

    def on_pread(_name: str, args: tuple[Any, ...]) -> None:
        preads.append(args[2])
        if not blocking.inside:
            preads_on_loop.append(args[2])

    monkeypatch.setattr(consumelog, "os", WatchedOs(("pread",), on_pread))
    first = rt.messages(3, prefix="old")
    later = rt.messages(2 * TAIL_ENTRIES + 10, prefix="new")
    async with (
        local.server(listen=None, run_blocking=blocking) as server,
        rt.memory_client(server, group="billing") as client,
        rt.memory_client(server, group="ops", subject="%dead%billing%orders") as ops,
    ):
        assert await client.send(first) == ["stored"] * 3
        pulled = await client.pull(3, **{"from": "earliest"})
        assert pulled.ids == [message.id for message in first]
        for start in range(0, len(later), 1000):  # the consume log's memory moves past them
            assert set(await client.send(later[start : start + 1000])) == {"stored"}
        assert preads == []
        blocking.calls.clear()
        names = {"group": "billing", "consumer": "c", "subject": "orders"}
        frame = await client._call(Command.NACK, {**names, "start": pulled.start, "end": pulled.end, "dead": True}, b"")
        assert frame.metadata["acked"] == pulled.end
        assert "ConsumeLog.read" in blocking.calls  # the entries came from the file ...
        assert preads and preads_on_loop == []  # ... in the worker call, never on the event loop
        dead = await ops.pull(10, **{"from": "earliest"})
        assert [(m.id, m.body, m.subject) for m in dead.messages] == [
            (m.id, m.body, "%dead%billing%orders") for m in first
        ]


# ----------------------------------------------------------------- pull-log descriptors


def test_an_evicted_pull_log_opens_again_and_appends_where_it_left_off(tmp_path: Path) -> None:
    files = OpenPullLogs(2)
    logs = [PullLog(tmp_path, f"{n:032x}", files=files) for n in range(3)]
    for n, pull_log in enumerate(logs):
        pull_log.write(0, encode_pull_entries([n * 10], [0]))
    assert len(files) == 2 and open_pull_log_fds(tmp_path) == 2  # logs[0] closed, the least recent
    logs[0].write(1, encode_pull_entries([1, 2], [0, 4]))  # opened again; logs[1] closes
    assert len(files) == 2 and open_pull_log_fds(tmp_path) == 2
    logs[1].write(1, encode_pull_entries([11], [0]))
    assert logs[0].read(0, 3) == ([0, 1, 2], [0, 0, 4])
    assert logs[1].read(0, 2) == ([10, 11], [0, 0])
    assert logs[0].path.stat().st_size == 3 * PULL_ENTRY_SIZE
    files.close()
    assert len(files) == 0 and open_pull_log_fds(tmp_path) == 0
    # A PULL that finishes after the master stopped still writes, and holds nothing open.
    logs[2].write(1, encode_pull_entries([21], [0]))
    assert logs[2].read(0, 2) == ([20, 21], [0, 0])
    assert len(files) == 0 and open_pull_log_fds(tmp_path) == 0


def test_the_checkpoint_fsyncs_the_open_descriptor_without_opening_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = OpenPullLogs(4)
    pull_log = PullLog(tmp_path, "ab" * 16, files=files)
    pull_log.write(0, encode_pull_entries([7], [0]))
    calls: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(pulllog, "os", WatchedOs(("open", "fsync"), lambda name, args: calls.append((name, args))))
    assert pull_log.flush() is False
    assert calls == [("fsync", (files.fd(pull_log),))]
    files.close()  # closed: the next checkpoint opens the file by name to fsync it
    calls.clear()
    pull_log.flush()
    assert [name for name, _ in calls] == ["open", "fsync"]


def test_a_pull_log_under_an_fsync_is_closed_later_never_under_it(tmp_path: Path) -> None:
    files = OpenPullLogs(1)
    busy = PullLog(tmp_path, "aa" * 16, files=files)
    other = PullLog(tmp_path, "bb" * 16, files=files)
    busy.write(0, encode_pull_entries([1], [0]))
    fd = files.fd(busy)
    with busy._lock:  # what ``flush`` holds in a worker thread while it fsyncs
        other.write(0, encode_pull_entries([2], [0]))  # evicts ``busy``: its close waits
        os.fstat(fd)  # still open: the fsync goes on on its own descriptor
        assert len(files) == 2
    other.write(1, encode_pull_entries([3], [0]))  # the next write closes it
    assert len(files) == 1 and open_pull_log_fds(tmp_path) == 1
    assert busy.read(0, 1) == ([1], [0])


async def test_more_consumers_than_the_bound_keep_at_most_the_bound_of_pull_logs_open(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    count = OPEN_PULL_LOGS + 44
    sent = rt.messages(count + 5)
    pull_dir = local.data / "pull"
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        await client.pull(1)  # the group's share starts here
        assert set(await client.send(sent)) == {"stored"}
        first = await client.pull(2)
        assert first.ids == [m.id for m in sent[:2]]
        for n in range(count):
            pulled = await rt.Client(client._call, consumer=f"c{n}").pull(1)
            assert pulled.count == 1
            assert open_pull_log_fds(pull_dir) <= OPEN_PULL_LOGS
        assert open_pull_log_fds(pull_dir) == OPEN_PULL_LOGS
        again = await client.pull(3)  # its pull log was closed: opened again, appended after entry 2
        assert (again.start, again.ids) == (2, [m.id for m in sent[count + 2 : count + 5]])
        assert open_pull_log_fds(pull_dir) == OPEN_PULL_LOGS
        assert await client.ack(0, 5) == 5
    assert open_pull_log_fds(pull_dir) == 0  # the server closed them all
    stem = consumer_key("orders", "g", "c").hex()
    assert PullLog(pull_dir, stem).read(0, 5) == ([0, 1, count + 2, count + 3, count + 4], [0] * 5)
    async with local.server(listen=None) as server, rt.memory_client(server) as client:  # a restart
        pulled = await client.pull(10)
        assert (pulled.start, pulled.acked, pulled.count) == (5, 5, 0)


# ----------------------------------------------------------------- consume logs

STORED_AT = 1_700_000_000_000


def test_an_index_step_after_the_indexer_closed_writes_its_files_and_holds_no_descriptor(tmp_path: Path) -> None:
    """A SEND whose append was in flight when its master stepped down is indexed after the master
    closed its indexer: each write opens and closes its file itself."""
    indexer = Indexer(tmp_path, indexed_offset=0)
    indexer.submit(0, 100, [("s.0", 0, 100, 0, 0)], ["k0"], STORED_AT)
    indexer.close()
    indexer.submit(100, 300, [("s.0", 100, 100, 0, 0), ("s.new", 200, 100, 0, 0)], ["k1", "k2"], STORED_AT + 1)
    assert indexer.stalled is None and indexer.indexed_offset == 300
    assert open_pull_log_fds(tmp_path) == 0 and len(indexer.files) == 0
    assert all(consume_log._fd == -1 for consume_log in indexer.logs.values())
    again = ConsumeLog.open(tmp_path, "s.0", checkpoint_count=2)
    assert again.read(0, 2) == encode_entry(0, 100, 0, STORED_AT) + encode_entry(100, 100, 0, STORED_AT + 1)
    again.close()
    new = ConsumeLog.open(tmp_path, "s.new", checkpoint_count=1)
    assert new.read(0, 1) == encode_entry(200, 100, 0, STORED_AT + 1)
    new.close()
