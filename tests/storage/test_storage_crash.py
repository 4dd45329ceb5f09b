"""A real crash: SIGKILL a process appending under the sync policy, then reopen its log."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from delaymq.protocol.envelope import RecordKind
from delaymq.storage.log import SegmentedLog

SEGMENT_SIZE = 4096

# Eight tasks append forever; a line is printed only after the append returned,
# that is after the fsync covering it.
CHILD = (
    """
import sys
import trio
from delaymq.protocol.envelope import RecordKind, encode
from delaymq.storage.log import SegmentedLog
from delaymq.storage.writer import open_log_writer

async def main(directory):
    log = SegmentedLog.open(directory, segment_size=%d)
    async with open_log_writer(log, flush="sync") as writer:
        async def appender(task):
            i = 0
            while True:
                payload = ("%%d:%%d:" %% (task, i)).encode() * 4
                offset = await writer.append(encode(RecordKind.MESSAGE, payload))
                sys.stdout.write("%%d %%d %%d\\n" %% (offset, task, i))
                sys.stdout.flush()
                i += 1
        async with trio.open_nursery() as nursery:
            for task in range(8):
                nursery.start_soon(appender, task)

trio.run(main, sys.argv[1])
"""
    % SEGMENT_SIZE
)


def read_lines(process: subprocess.Popen[bytes], count: int, timeout: float = 60) -> list[bytes]:
    """Complete lines from the child's stdout until ``count`` of them (or EOF if count < 0)."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    lines: list[bytes] = []
    pending = b""
    deadline = time.monotonic() + timeout
    while count < 0 or len(lines) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"child acknowledged only {len(lines)} appends in {timeout} s"
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            if count >= 0:
                assert process.stderr is not None
                raise AssertionError(f"child exited early: {process.stderr.read().decode()}")
            break
        *complete, pending = (pending + chunk).split(b"\n")
        lines.extend(complete)
    return lines  # a torn last line was never acknowledged: left out


def test_every_acknowledged_append_survives_sigkill(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-P", "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    try:
        lines = read_lines(process, 400)
        process.send_signal(signal.SIGKILL)
        lines += read_lines(process, -1)  # lines printed before the kill landed
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL

    acknowledged = {}
    for line in lines:
        offset, task, i = map(int, line.split())
        acknowledged[offset] = f"{task}:{i}:".encode() * 4
    assert len(acknowledged) == len(lines) >= 400

    with SegmentedLog.open(tmp_path, segment_size=SEGMENT_SIZE) as log:
        assert len(log.segments()) > 1
        for offset, payload in acknowledged.items():
            record = log.read(offset)
            assert (record.kind, record.payload) == (RecordKind.MESSAGE, payload)
        everything = [r.payload for r in log.iter_from(0)]
        assert len(everything) == len(set(everything)) >= len(acknowledged)
        # And the reopened log takes appends after whatever survived.
        end = log.end_offset
        assert log.append_record(RecordKind.MESSAGE, b"after the crash") == end
        assert log.read(end).payload == b"after the crash"
