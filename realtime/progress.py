"""Progress records: consumer progress in the message log, so slaves get it with the messages.

A realtime group's slaves copy the master's message log byte for byte
(``delaymq.replication``) and index it into consume logs of their own, so their
consume-log sequences are the master's. What the log did not hold is the state a
checkpoint commits to lmdb: group positions and given-back messages (shares),
consumers' pull-log lengths, acked ranges and hand-outs, and the fence table. Under
replication the master appends that state to its message log as a **progress record**
(envelope kind ``RecordKind.PROGRESS``) before it commits it to lmdb, and answers an
ACK, or a PULL under sync replication, only once the record is replicated. A slave
applies progress records in log order (``delaymq.realtime.replica``), and a promoted
slave opens its data folder as a restarted master would: same positions, same pull
logs, so nothing acked is handed out again and every hand-out not acked comes back
with its redelivery count raised.

A record holds whole state records (the checkpoint's own encodings), so applying one
again, or a later one over it, leaves the state of the latest: replay after a crash
needs no bookkeeping. A record with ``reset`` ends the master's whole state (written
when a master session begins): keys it does not keep are deleted. A state too large for
one record goes out as several (``Progress.records``), the last one carrying ``reset``
and the keys to keep.

Payload (msgpack map)::

    v          1
    reset      bool
    shares     [[share key (16 bytes), share record], ...]          (checkpoint.encode_share)
    consumers  [[consumer key (16 bytes), consumer record, first, entries], ...]
               (checkpoint.encode_consumer; ``entries``: pull-log entries from sequence
               ``first`` on, as pull/<stem>.log holds them; empty when none are new)
    fences     {scheduler group: epoch}
    clear      [scheduler group, ...]: fences an admin cleared (CLEAR_FENCE), applied before
               ``fences``; absent in records written before it existed (read as none)
    keep       [[share keys], [consumer keys]] or nil: with ``reset``, the keys that stay
               (nil: the keys this record names)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import msgpack

from delaymq.protocol.envelope import HEADER, HEADER_SIZE, RecordKind, encode
from delaymq.realtime.groups import ConsumerState
from delaymq.realtime.pulllog import encode_pull_entries
from delaymq.storage.errors import CorruptLog

PROGRESS_KIND = int(RecordKind.PROGRESS)
MESSAGE_KIND = int(RecordKind.MESSAGE)
PROGRESS_VERSION = 1


@dataclass(slots=True)
class ConsumerProgress:
    key: bytes
    record: bytes  # checkpoint.encode_consumer
    first: int  # pull-log sequence of the first entry in ``entries``
    entries: bytes  # pull-log entries (pulllog.encode_pull_entries)


@dataclass(slots=True)
class Progress:
    """One progress record's contents (see the module docstring)."""

    reset: bool = False
    shares: list[tuple[bytes, bytes]] = field(default_factory=list)
    consumers: list[ConsumerProgress] = field(default_factory=list)
    fences: dict[str, int] = field(default_factory=dict)
    clear: list[str] = field(default_factory=list)  # groups whose fence goes, before ``fences`` apply
    keep: tuple[set[bytes], set[bytes]] | None = None  # with reset: (share keys, consumer keys) that stay

    def empty(self) -> bool:
        return not (self.reset or self.shares or self.consumers or self.fences or self.clear)

    def kept(self) -> tuple[set[bytes], set[bytes]]:
        """With ``reset``: the share and consumer keys that stay."""
        if self.keep is not None:
            return self.keep
        return {key for key, _ in self.shares}, {c.key for c in self.consumers}

    def encode(self) -> bytes:
        """The whole record, envelope included: appended to the message log as it is."""
        payload = msgpack.packb(
            {
                "v": PROGRESS_VERSION,
                "reset": self.reset,
                "shares": [[key, record] for key, record in self.shares],
                "consumers": [[c.key, c.record, c.first, c.entries] for c in self.consumers],
                "fences": self.fences,
                **({"clear": self.clear} if self.clear else {}),
                "keep": None if self.keep is None else [sorted(self.keep[0]), sorted(self.keep[1])],
            },
            use_bin_type=True,
        )
        return encode(PROGRESS_KIND, payload)

    def records(self, max_record: int) -> list[bytes]:
        """This progress as records of at most about a quarter of ``max_record`` each: one
        record when it fits, else upserts in chunks, then (for a reset) a last record with
        ``reset``, the fences and the keys to keep."""
        whole = self.encode()
        if len(whole) <= max_record // 2:
            return [whole]
        budget = max(1, max_record // 4)
        out: list[bytes] = []
        chunk = Progress()
        size = 0

        def add(item_size: int) -> None:
            nonlocal chunk, size
            if size and size + item_size > budget:
                out.append(chunk.encode())
                chunk, size = Progress(), 0
            size += item_size

        for key, record in self.shares:
            add(len(key) + len(record) + 16)
            chunk.shares.append((key, record))
        for consumer in self.consumers:
            add(len(consumer.key) + len(consumer.record) + len(consumer.entries) + 32)
            chunk.consumers.append(consumer)
        if chunk.shares or chunk.consumers:
            out.append(chunk.encode())
        last = Progress(
            reset=self.reset, fences=self.fences, clear=self.clear, keep=self.kept() if self.reset else None
        )
        if not last.empty():
            out.append(last.encode())
        return out

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> Progress:
        """A record's payload (the envelope checked already); ``CorruptLog`` if it is not one."""
        try:
            data = msgpack.unpackb(payload, raw=False)
            if data.get("v") != PROGRESS_VERSION:
                raise CorruptLog(f"progress record of version {data.get('v')!r}; this server reads {PROGRESS_VERSION}")
            return cls(
                reset=bool(data["reset"]),
                shares=[(bytes(key), bytes(record)) for key, record in data["shares"]],
                consumers=[
                    ConsumerProgress(bytes(key), bytes(record), int(first), bytes(entries))
                    for key, record, first, entries in data["consumers"]
                ],
                fences={str(group): int(epoch) for group, epoch in data["fences"].items()},
                clear=[str(group) for group in data.get("clear") or ()],
                keep=None
                if data.get("keep") is None
                else ({bytes(k) for k in data["keep"][0]}, {bytes(k) for k in data["keep"][1]}),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptLog(f"a progress record does not decode: {error}") from error


def ship_consumers(consumers: list[tuple[ConsumerState, bytes]], *, whole: bool = False) -> list[ConsumerProgress]:
    """Progress of committed consumer records, with the pull-log entries not shipped yet (all
    from the acked position with ``whole``); marks them shipped (``unship`` undoes it)."""
    out = []
    for consumer, record in consumers:
        base = consumer.window_base
        first = consumer.acked if whole else max(consumer.shipped, base)
        entries = encode_pull_entries(
            consumer.sequences[first - base : consumer.length - base],
            consumer.redeliveries[first - base : consumer.length - base],
        )
        out.append(ConsumerProgress(consumer.key, record, first, entries))
        consumer.shipped = consumer.length
    return out


def unship(consumers: list[tuple[ConsumerState, bytes]], progress: Progress) -> None:
    """A progress record that was not replicated: its entries go into the next one."""
    for (consumer, _record), shipped in zip(consumers, progress.consumers, strict=False):
        consumer.shipped = min(consumer.shipped, shipped.first)


def kind_runs(data: bytes, base: int = 0) -> Iterator[tuple[int, int, int]]:
    """``(kind, start, end)`` of each run of records of one kind in ``data`` (whole records,
    as ``SegmentedLog.read_raw`` returns them; CRCs are checked by their readers)."""
    unpack = HEADER.unpack_from
    pos = base
    stop = len(data)
    run_kind, run_start = -1, base
    while pos < stop:
        size, _magic, _version, kind, _crc = unpack(data, pos)
        if kind != run_kind:
            if pos > run_start:
                yield run_kind, run_start, pos
            run_kind, run_start = kind, pos
        pos += HEADER_SIZE + size
    if pos > run_start:
        yield run_kind, run_start, pos


__all__ = ["MESSAGE_KIND", "PROGRESS_KIND", "ConsumerProgress", "Progress", "kind_runs", "ship_consumers", "unship"]
