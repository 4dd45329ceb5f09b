"""Tag masks: a message's tags as 64 bits, so a server filters by tag without reading records."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from functools import lru_cache


@lru_cache(maxsize=4096)
def tag_bit(tag: str) -> int:
    """The one bit of ``tags_mask`` a tag sets."""
    return 1 << (zlib.crc32(tag.encode()) % 64)


def tags_mask(tags: Iterable[str]) -> int:
    """A 64-bit mask ORing each tag's bit, for server-side tag filters.

    A consume-log entry keeps the mask of its message's tags; a filter on tag
    ``t`` skips entries with ``mask & tag_bit(t) == 0``. Different tags can share
    a bit, so a match still needs the exact check on the client.
    """
    mask = 0
    for tag in tags:
        mask |= tag_bit(tag)
    return mask


__all__ = ["tag_bit", "tags_mask"]
