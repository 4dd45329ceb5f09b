"""Sequential reading of envelope records from a file: message-log segments, schedule logs.

``RecordScan`` reads a byte range in large chunks and yields each record that
checks (``delaymq.protocol.envelope.iter_spans``: size, magic, version, CRC). It
stops at the first record that does not, and says where and why (``end``,
``problem``; ``torn`` when the range simply ends inside a record, as the tail of a
log being written does).
"""

from __future__ import annotations

from collections.abc import Iterator

from delaymq.backlog.files import FileReader
from delaymq.backlog.formats import HEADER_SIZE, CorruptRecord, Span, TruncatedRecord, iter_spans

CHUNK = 16 << 20


class RecordScan:
    """The records of ``reader`` in ``[start, stop)``: iterate for ``(file offset, buffer, span)``."""

    def __init__(self, reader: FileReader, start: int, stop: int, *, chunk: int = CHUNK) -> None:
        self._reader = reader
        self.start = start
        self.stop = stop
        self._chunk = chunk
        self.end = start  # where the last good record ends
        self.problem = ""  # why the scan stopped before ``stop`` ("" if it did not)
        self.torn = False  # it stopped because the range ends inside a record

    def __iter__(self) -> Iterator[tuple[int, bytes, Span]]:
        offset = self.start
        stop = self.stop
        while offset < stop:
            want = min(self._chunk, stop - offset)
            buf = self._reader.read(offset, want)
            if len(buf) < want:  # the file is shorter than the range
                stop = offset + len(buf)
                if not buf:
                    self.problem = f"file ends at byte {offset}, before {self.stop}"
                    self.torn = True
                    return
            used = 0
            try:
                for span in iter_spans(buf):
                    yield offset + span.start, buf, span
                    used = span.end
                    self.end = offset + used
            except TruncatedRecord as error:
                used = error.offset
                if offset + len(buf) >= stop:  # the range ends inside this record
                    self.problem = (
                        f"ends inside a record at byte {offset + used}"
                        if stop == self.stop
                        else f"file ends at byte {stop}, inside a record starting at byte {offset + used}"
                    )
                    self.torn = True
                    return
                if used == 0:  # one record longer than a chunk: read it whole
                    size = int.from_bytes(buf[:4], "big") + HEADER_SIZE
                    whole = self._reader.read(offset, size)
                    if len(whole) < size:
                        self.problem = f"file ends inside the record at byte {offset}"
                        self.torn = True
                        return
                    try:
                        spans = list(iter_spans(whole))
                    except CorruptRecord as error:
                        self.problem = f"{error.reason} at byte {offset}"
                        return
                    yield offset, whole, spans[0]
                    used = size
                    self.end = offset + used
            except CorruptRecord as error:
                self.problem = f"{error.reason} at byte {offset + error.offset}"
                return
            offset += used
        if offset < self.stop:  # the file ends, at a record boundary, before the range does
            self.problem = f"file ends at byte {offset}, before byte {self.stop}"
            self.torn = True


__all__ = ["CHUNK", "RecordScan"]
