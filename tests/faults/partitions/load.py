"""The load of a partition scenario, run inside a namespace of its own: ``python -P load.py CONFIG.json``.

It imports only ``delaymq`` (run by path, not as a package), and talks to the test through files
in the config's ``out`` folder, since the test's own process is outside every namespace:

- ``status.jsonl``: from the start, each server's STATUS every ``watch_interval`` s (role and
  epoch of each member; the metaserver's rows), one line per answer;
- once the file ``go`` appears, producers send scheduled messages (SCHEDULE, due ``delay`` s
  ahead) and immediate ones (SEND), each batch again with the same ids until a group takes it,
  and a consumer takes and acks everything: ``acked.jsonl`` (a line per acknowledged batch: ids,
  deliver_at, first try and answer times), ``answers.jsonl`` (which server answered each
  successful SEND or SCHEDULE, and when it was asked), ``received.jsonl`` (a line per receipt);
- once ``stop`` appears, the producers stop and the consumer goes on until it has every
  acknowledged id or ``drain_s`` passed; then ``done`` is written and the process exits.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import trio

from delaymq.bench.failover import epoch_of, role_of
from delaymq.client import open_consumer, open_producer
from delaymq.client.producer import Producer
from delaymq.client.routes import CLIENT_PEERS_OPTIONS
from delaymq.net.peers import Peers, open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.frames import Frame
from delaymq.protocol.records import Message, decode_batch

BODY = b"p" * 100
#: How long one STATUS may take before the watcher notes nothing and asks again.
STATUS_TIMEOUT_S = 0.5
#: What the watcher keeps of each row of the metaserver's STATUS.
META_FIELDS = ("group", "address", "role", "epoch", "in_sync")
#: Control files are looked for this often.
CONTROL_POLL_S = 0.05


def wall_ms() -> int:
    """The machine's clock in epoch ms (every namespace shares it): what deliver_at is compared with."""
    return time.time_ns() // 1_000_000


@dataclass
class Files:
    """The output files, line-buffered so the test reads each line as soon as it is written."""

    out: Path
    handles: dict[str, IO[str]] = field(default_factory=dict)

    def write(self, name: str, row: dict[str, Any]) -> None:
        if name not in self.handles:
            self.handles[name] = open(self.out / name, "a", buffering=1)
        self.handles[name].write(json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


class RecordingCaller:
    """The producer's connections, noting which server answered each successful SEND or SCHEDULE:
    the test checks from it that no deposed master acknowledged a write."""

    def __init__(self, peers: Peers, files: Files) -> None:
        self._peers = peers
        self._files = files

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Frame:  # fmt: skip
        asked = wall_ms()
        frame = await self._peers.call(address, command, metadata, body, timeout=timeout)
        if command in (Command.SEND, Command.SCHEDULE):
            ids = [message.id for message in decode_batch(body)]
            self._files.write("answers.jsonl", {"address": address, "asked": asked, "answered": wall_ms(), "ids": ids})
        return frame


@dataclass
class State:
    """What the drain needs to know: acknowledged and received ids."""

    acked: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    changed: trio.Event = field(default_factory=trio.Event)

    def note(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


def new_batch(
    producer: Producer, subject: str, count: int, delay: Sequence[float] | None, rng: random.Random
) -> list[Message]:
    """``count`` messages, due a random ``delay`` (low, high) s ahead, or immediate."""
    return [producer.message(subject, BODY, delay=rng.uniform(*delay) if delay else None) for _ in range(count)]


async def produce(producer: Producer, config: dict[str, Any], state: State, files: Files, seed: int) -> None:
    """A batch every ``interval`` s (scheduled ones when ``delay`` is given) until cancelled; ``seed``
    numbers the stream."""
    rng = random.Random(seed)
    subject, delay = config["subject"], config.get("delay")
    while True:
        batch = new_batch(producer, subject, config["batch"], delay, rng)
        first_try = wall_ms()
        while True:
            try:
                await producer.send_batch(batch)
                break
            except Exception:  # no master reachable now: the same ids again, as a user would
                await trio.sleep(0.05)  # a retry backoff, not a synchronisation
        ids = [message.id for message in batch]
        due = [message.deliver_at for message in batch]
        files.write("acked.jsonl", {"ids": ids, "due": due, "first_try": first_try, "acked": wall_ms(), "stream": seed})
        state.acked.update(ids)
        await trio.sleep(config["interval"])  # the producer's pace


async def consume(meta: str, subject: str, state: State, files: Files, *, task_status: Any) -> None:
    """Take and ack every message of ``subject`` until cancelled; a line per receipt."""
    async with open_consumer(
        meta, subject, group="partitions", start="earliest", pull_batch=200, max_messages_held=5_000,
        poll_timeout=1.0, request_timeout=3.0,
    ) as consumer:  # fmt: skip
        task_status.started()
        while True:
            for message in await consumer.receive_batch():
                row = {"id": message.id, "due": message.deliver_at, "at": message.received_at}
                files.write("received.jsonl", {**row, "attempts": message.attempts})
                state.received.add(message.id)
                await message.ack()
            state.note()


async def watch(peers: Peers, group: str, address: str, interval: float, files: Files) -> None:
    """STATUS of one server every ``interval`` s until cancelled; a line per answer."""
    while True:
        asked = wall_ms()
        try:
            frame = await peers.call(address, Command.STATUS, {}, timeout=STATUS_TIMEOUT_S)
        except Exception:  # cut off or busy: nothing to note, asked again next time
            frame = None
        if frame is not None:
            # The state it shows held at some moment between ``asked`` and ``at``.
            row: dict[str, Any] = {"asked": asked, "at": wall_ms(), "address": address, "group": group}
            answer = frame.metadata
            if group == "meta":
                row["rows"] = [{key: r.get(key) for key in META_FIELDS} for r in answer["rows"]]
            else:
                row.update(role=role_of(answer), epoch=epoch_of(answer))
            files.write("status.jsonl", row)
        await trio.sleep(interval)  # the watcher's sampling period


async def wait_for_file(path: Path) -> None:
    """Until the test creates ``path`` (another process: no event to wait on)."""
    while not path.exists():
        await trio.sleep(CONTROL_POLL_S)


async def run_load(config: dict[str, Any], files: Files, state: State) -> None:
    out = Path(config["out"])
    meta = config["meta"]
    await wait_for_file(out / "go")
    async with trio.open_nursery() as nursery:
        await nursery.start(consume, meta, config["subject"], state, files)
        async with open_peers(request_timeout=3.0, connect_timeout=2.0, **CLIENT_PEERS_OPTIONS) as tcp:
            async with open_producer(meta, timeout=2.0, peers=RecordingCaller(tcp, files)) as producer:
                with trio.CancelScope() as producing:
                    async with trio.open_nursery() as producers:
                        for n, stream in enumerate(config["streams"]):
                            options = {"subject": config["subject"], **stream}
                            producers.start_soon(produce, producer, options, state, files, n)
                        await wait_for_file(out / "stop")
                        producing.cancel()
        with trio.move_on_after(config["drain_s"]):
            while not state.acked <= state.received:
                await state.changed.wait()
        nursery.cancel_scope.cancel()
    (out / "done").write_text(json.dumps({"drained": state.acked <= state.received}))


async def main(config: dict[str, Any]) -> None:
    files, state = Files(Path(config["out"])), State()
    try:
        async with open_peers(
            request_timeout=STATUS_TIMEOUT_S, connect_timeout=STATUS_TIMEOUT_S, **CLIENT_PEERS_OPTIONS
        ) as peers:
            async with trio.open_nursery() as nursery:
                for group, addresses in config["watch"].items():
                    for address in addresses:
                        nursery.start_soon(watch, peers, group, address, config["watch_interval"], files)
                await run_load(config, files, state)
                nursery.cancel_scope.cancel()
    finally:
        files.close()


def entry(argv: Sequence[str]) -> None:
    trio.run(main, json.loads(Path(argv[1]).read_text()))


if __name__ == "__main__":
    entry(sys.argv)
