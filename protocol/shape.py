"""How big msgpack bytes would be once decoded, told without decoding them.

A frame's metadata is msgpack, and msgpack is compact: one byte ``0x90`` is an
empty list, some 56 bytes of Python objects. So a frame of metadata can cost
far more memory than its size, and nesting costs stack. ``shape_problem`` walks
the bytes' type headers (no objects are made) and counts objects and depth, so
the decoder refuses what is too many or too deep before ``msgpack.unpackb``
builds anything. Sans-IO: bytes in, a reason or None out.
"""

from __future__ import annotations

import struct

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

# Type bytes that are followed by a fixed number of bytes and hold no objects.
_FIXED = {
    0xC0: 0, 0xC2: 0, 0xC3: 0,  # nil, false, true
    0xCA: 4, 0xCB: 8,  # float 32, 64
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,  # uint 8..64
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,  # int 8..64
    0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,  # fixext 1..16 (type byte + data)
}  # fmt: skip
# Type bytes followed by a length of 1, 2 or 4 bytes, then that many bytes (ext: one more, its type).
_SIZED = {
    0xC4: (_U8, 0), 0xC5: (_U16, 0), 0xC6: (_U32, 0),  # bin
    0xC7: (_U8, 1), 0xC8: (_U16, 1), 0xC9: (_U32, 1),  # ext
    0xD9: (_U8, 0), 0xDA: (_U16, 0), 0xDB: (_U32, 0),  # str
}  # fmt: skip
# Type bytes of arrays and maps with a 2- or 4-byte count (a map's count is pairs).
_CONTAINERS = {0xDC: (_U16, 1), 0xDD: (_U32, 1), 0xDE: (_U16, 2), 0xDF: (_U32, 2)}


def shape_problem(raw: bytes | bytearray | memoryview, *, max_items: int, max_depth: int) -> str | None:
    """Why ``raw`` holds too many objects or nests too deep; None if it does not.

    Bytes that are not msgpack are left for the decoder to name (None).
    """
    if len(raw) <= min(max_items, max_depth):
        return None  # each object takes a byte at least: neither cap can be reached
    pending = [1]  # objects still to read at each open level
    pos, end, items = 0, len(raw), 0
    try:
        while pending:
            if not pending[-1]:
                pending.pop()
                continue
            pending[-1] -= 1
            kind = raw[pos]
            pos += 1
            items += 1
            if items > max_items:
                return f"holds more than {max_items} objects"
            if kind <= 0x7F or kind >= 0xE0:  # fixints
                continue
            count = 0
            if kind <= 0x8F:  # fixmap
                count = (kind & 0x0F) * 2
            elif kind <= 0x9F:  # fixarray
                count = kind & 0x0F
            elif kind <= 0xBF:  # fixstr
                pos += kind & 0x1F
            elif kind in _FIXED:
                pos += _FIXED[kind]
            elif kind in _SIZED:
                length, extra = _SIZED[kind]
                pos += length.size + extra + length.unpack_from(raw, pos)[0]
            elif kind in _CONTAINERS:
                width, per = _CONTAINERS[kind]
                count = width.unpack_from(raw, pos)[0] * per
                pos += width.size
            else:
                return None  # 0xC1, never used: the decoder says so
            if count:
                if len(pending) > max_depth:
                    return f"nests maps and arrays deeper than {max_depth}"
                if count > end - pos:  # each object takes a byte: a count past the end is a lie
                    return None
                pending.append(count)
            if pos > end:
                return None
    except (IndexError, struct.error):
        return None  # cut short: the decoder says so
    return None


__all__ = ["shape_problem"]
