"""Message ids: 32 lowercase hex characters, time-ordered when the caller gives the time."""

from __future__ import annotations

import itertools
import os
import uuid

_id_random = int.from_bytes(os.urandom(5), "big")
_id_counter = itertools.count(int.from_bytes(os.urandom(4), "big"))
#: The millisecond of the last id made and its leading digits (millisecond and random): the
#: ids of a batch share them, so each costs one formatted number, not three. One tuple,
#: replaced whole, so threads making ids never pair one millisecond with another's digits.
_id_prefix = (-1, "")


def _reseed_ids() -> None:
    global _id_random, _id_counter, _id_prefix
    _id_random = int.from_bytes(os.urandom(5), "big")
    _id_counter = itertools.count(int.from_bytes(os.urandom(4), "big"))
    _id_prefix = (-1, "")


os.register_at_fork(after_in_child=_reseed_ids)


def new_message_id(now_ms: int | None = None) -> str:
    """A unique message id of 32 lowercase hex characters.

    With ``now_ms`` the id is time-ordered like a UUIDv7: 12 hex digits of the
    millisecond, 10 of a per-process random value, 10 of a per-process counter,
    so ids from one process sort in creation order. Without it, a random UUID4.
    """
    global _id_prefix
    if now_ms is None:
        return uuid.uuid4().hex
    prefix_ms, prefix = _id_prefix
    if now_ms != prefix_ms:
        prefix = f"{now_ms & 0xFFFF_FFFF_FFFF:012x}{_id_random:010x}"
        _id_prefix = (now_ms, prefix)
    return f"{prefix}{next(_id_counter) & 0xFF_FFFF_FFFF:010x}"


__all__ = ["new_message_id"]
