"""Every shape of message gets the same index key on the SCHEDULE path and on filing.

Both paths read plain messages (no retry, no properties) at fixed offsets and hand the
rest to ``record_key``: a retry, a ``key`` property, or properties without one must
still be indexed under the key docs/cancel.md gives them.
"""

from __future__ import annotations

from typing import Any

from delaymq.protocol.records import encode_message, scan_batch
from delaymq.scheduler.idindex import SCHEDULED, ids_for_key, index_key, key_hash, lookup
from delaymq.scheduler.schedule import index_keys

from ..conftest import ScheduleFolder

AT = 1_749_996_000_000 + 30_000


def _shapes() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("plain", {}),
        ("retried", {"attempts": 2}),
        ("keyed", {"properties": {"key": "order-7"}}),
        ("keyed-retried", {"attempts": 1, "properties": {"key": "order-8"}}),
        ("other-props", {"properties": {"region": "eu"}}),
        ("key-and-more", {"properties": {"key": "order-9", "region": "eu"}}),
    ]


def _records() -> list[bytes]:
    return [
        encode_message(name, "orders", body=b"x" * 10, deliver_at=AT + i, created_at=AT - 1000, **extra)
        for i, (name, extra) in enumerate(_shapes())
    ]


def _expected() -> list[tuple[str, bytes | None]]:
    out = []
    for name, extra in _shapes():
        key = extra.get("properties", {}).get("key")
        out.append(
            (index_key(name, "orders", extra.get("attempts", 0)), None if key is None else key_hash("orders", key))
        )
    return out


def test_the_schedule_path_names_each_shape_by_its_index_key_and_key_hash() -> None:
    batch = scan_batch(b"".join(_records()))
    keys, hashes = index_keys(batch)
    assert list(zip(keys, hashes)) == _expected()


def test_filing_indexes_each_shape_under_its_index_key_and_key_hash(store_folder: ScheduleFolder) -> None:
    store_folder.add(*_records())
    expected = _expected()
    values = lookup(store_folder.state, [k for k, _h in expected])
    for i, ((k, hashed), value) in enumerate(zip(expected, values)):
        assert value is not None, k
        assert (value.deliver_at, value.entry, value.state, value.key_hash) == (AT + i, i, SCHEDULED, hashed)
    assert ids_for_key(store_folder.state, "orders", "order-7") == ["keyed"]
    assert lookup(store_folder.state, ["unknown-id"]) == [None]
