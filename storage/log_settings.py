"""A segmented log's settings: their defaults and limits, and the FORMAT parameters they are stored as."""

from __future__ import annotations

from collections.abc import Mapping

from delaymq.storage.format import FormatValue

LOG_FORMAT = "segmented-log"
LOG_FORMAT_VERSION = 1
DEFAULT_SEGMENT_SIZE = 1 << 30
DEFAULT_MAX_RECORD = 16 << 20
#: A flush saves the verified end once it is this far behind: what an open checks again at most.
DEFAULT_CHECKPOINT_BYTES = 16 << 20

_RESERVED_PARAMS = frozenset({"format", "version", "segment_size", "max_record"})


def check_max_record(max_record: int) -> None:
    """``ValueError`` if protocol limits allow records larger than a message log holds.

    Servers open their message log with ``DEFAULT_MAX_RECORD``; they check their
    limits against it before touching the data folder.
    """
    if max_record > DEFAULT_MAX_RECORD:
        raise ValueError(
            f"limits allow records of {max_record} bytes; the message log holds at most {DEFAULT_MAX_RECORD}"
        )


def format_params(
    segment_size: int, max_record: int, checkpoint_bytes: int, extra_format: Mapping[str, FormatValue] | None
) -> dict[str, FormatValue]:
    """The FORMAT parameters of a log opened with these settings; ``ValueError`` for a bad one."""
    if segment_size <= 0:
        raise ValueError(f"segment_size must be positive, got {segment_size}")
    if checkpoint_bytes <= 0:
        raise ValueError(f"checkpoint_bytes must be positive, got {checkpoint_bytes}")
    if not 0 < max_record < 1 << 32:
        raise ValueError(f"max_record must be in [1, {(1 << 32) - 1}], got {max_record}")
    params: dict[str, FormatValue] = {
        "format": LOG_FORMAT,
        "version": LOG_FORMAT_VERSION,
        "segment_size": segment_size,
        "max_record": max_record,
    }
    for name, value in (extra_format or {}).items():
        if name in _RESERVED_PARAMS:
            raise ValueError(f"extra_format may not set the log's own parameter {name!r}")
        params[name] = value
    return params
