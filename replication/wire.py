"""FETCH on the wire: a slave asks its master for the log from its own end.

One request/answer pair serves catch-up and live streaming alike (Kafka's replica
fetcher): the request says where the slave's durable log ends (which is also its
acknowledgement of everything before), the answer carries the master's durable bytes
from there (the frame body), the master's epoch history, its tick, and the side
journal's entries after the slave's position in it (the scheduler's dispatch-log
records). An answer with ``truncate_to`` carries no bytes: the slave holds a tail the
master never had and must cut it first.

Plain dataclasses and metadata dicts, checked field by field (errors name the field).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from delaymq.protocol.errors import RemoteProtocolError

#: The answer's error codes (besides the transport's).
NOT_MASTER = "not_master"  # retryable: ask the metaserver who the master is now
STALE_EPOCH = "stale_epoch"  # the request's epoch is newer than the master's: it was replaced
OFFSET_DELETED = "offset_deleted"  # the slave's end lies before the master's first segment


def _int(metadata: Mapping[str, Any], name: str, *, minimum: int = 0) -> int:
    value = metadata.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RemoteProtocolError(
            f"FETCH field {name!r} must be an integer >= {minimum}", code="bad_metadata", field=name
        )
    return value


def _str(metadata: Mapping[str, Any], name: str, *, optional: bool = False) -> str | None:
    value = metadata.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise RemoteProtocolError(f"FETCH field {name!r} must be a non-empty string", code="bad_metadata", field=name)
    return value


def _pairs(value: object, name: str) -> list[tuple[int, int]]:
    if not isinstance(value, list):
        raise RemoteProtocolError(f"FETCH field {name!r} must be a list", code="bad_metadata", field=name)
    pairs = []
    for item in value:
        if not (isinstance(item, list | tuple) and len(item) == 2 and all(isinstance(v, int) for v in item)):
            raise RemoteProtocolError(f"FETCH field {name!r} holds a bad pair", code="bad_metadata", field=name)
        pairs.append((int(item[0]), int(item[1])))
    return pairs


@dataclass(frozen=True, slots=True)
class FetchRequest:
    group: str
    address: str  # the slave's own address (its identity to the master)
    epoch: int  # the group epoch the slave knows
    offset: int  # the slave's log end, durable: everything below it is acknowledged
    last_epoch: int  # the newest epoch in the slave's history (0: none)
    session: str | None = None  # the master session ``seq`` counts in (None: never fetched from it)
    seq: int = 0  # journal entries of that session the slave holds
    max_bytes: int = 4 << 20

    def as_metadata(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "address": self.address,
            "epoch": self.epoch,
            "offset": self.offset,
            "last_epoch": self.last_epoch,
            "session": self.session,
            "seq": self.seq,
            "max_bytes": self.max_bytes,
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> FetchRequest:
        group = _str(metadata, "group")
        address = _str(metadata, "address")
        assert group is not None and address is not None
        return cls(
            group=group,
            address=address,
            epoch=_int(metadata, "epoch"),
            offset=_int(metadata, "offset"),
            last_epoch=_int(metadata, "last_epoch"),
            session=_str(metadata, "session", optional=True),
            seq=_int(metadata, "seq"),
            max_bytes=_int(metadata, "max_bytes", minimum=1),
        )


@dataclass(frozen=True, slots=True)
class FetchAnswer:
    epoch: int
    offset: int  # where the body's bytes go (the request's offset)
    durable_end: int  # the master's durable log end when answering
    start_offset: int  # the master's first retained offset
    history: list[tuple[int, int]]
    session: str
    seq: int  # the journal position after the entries carried
    journal: list[bytes] = field(default_factory=list)
    reset: bool = False  # ``journal`` is a full snapshot: the slave's position was not covered
    tick: bytes = b""
    now_ms: int = 0  # the master's wall clock when answering (for lag in ms)
    truncate_to: int | None = None

    def as_metadata(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "durable_end": self.durable_end,
            "start_offset": self.start_offset,
            "history": [list(pair) for pair in self.history],
            "session": self.session,
            "seq": self.seq,
            "journal": self.journal,
            "reset": self.reset,
            "tick": self.tick,
            "now_ms": self.now_ms,
            "truncate_to": self.truncate_to,
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> FetchAnswer:
        journal = metadata.get("journal")
        if not isinstance(journal, list) or not all(isinstance(item, bytes) for item in journal):
            raise RemoteProtocolError(
                "FETCH answer 'journal' must be a list of bytes", code="bad_metadata", field="journal"
            )
        tick = metadata.get("tick", b"")
        if not isinstance(tick, bytes):
            raise RemoteProtocolError("FETCH answer 'tick' must be bytes", code="bad_metadata", field="tick")
        truncate_to = metadata.get("truncate_to")
        session = _str(metadata, "session")
        assert session is not None
        return cls(
            epoch=_int(metadata, "epoch"),
            offset=_int(metadata, "offset"),
            durable_end=_int(metadata, "durable_end"),
            start_offset=_int(metadata, "start_offset"),
            history=_pairs(metadata.get("history"), "history"),
            session=session,
            seq=_int(metadata, "seq"),
            journal=journal,
            reset=bool(metadata.get("reset", False)),
            tick=tick,
            now_ms=_int(metadata, "now_ms"),
            truncate_to=None if truncate_to is None else _int(metadata, "truncate_to"),
        )


__all__ = ["NOT_MASTER", "OFFSET_DELETED", "STALE_EPOCH", "FetchAnswer", "FetchRequest"]
