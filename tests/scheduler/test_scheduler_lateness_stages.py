"""The lateness of each stage of the delay path, as the servers' STATUS statistics report it.

The scheduler counts how late it fired each message, the realtime server how late it
accepted and handed out each one (``delaymq bench delay`` prints them). Real servers
on an in-memory network under ``autojump_clock`` (see conftest.py).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import trio

from delaymq.protocol.commands import Command
from delaymq.protocol.histogram import LatencyHistogram


async def test_every_message_is_counted_once_per_stage_and_the_stages_add_up(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    count = 200
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler() as scheduler:
        clock = cluster.clock
        t0 = clock.now_ms()
        rng = random.Random(3)
        records = [sched.message(f"m{i:04d}", t0 + 5_000 + rng.randrange(20_000)) for i in range(count)]
        await cluster.schedule_raw(records)
        receiver = cluster.receiver()
        got = await receiver.wait_for(count)
        status = (await cluster.net.call("rt1.test:1", Command.STATUS, {})).metadata["statistics"]
        fired = LatencyHistogram.from_wire(scheduler.statistics().lateness_fired)

    accepted = LatencyHistogram.from_wire(status["lateness_accepted"])
    handed_out = LatencyHistogram.from_wire(status["lateness_handed_out"])
    received = [r.received_at - r.deliver_at for r in got]
    for stage in (fired, accepted, handed_out):
        assert stage.count == count  # each message once: none missed, none redelivered
        assert stage.early == 0
    assert fired.max <= 2  # fired at its own millisecond: nothing is busy under the mock clock
    # A message is fired, then accepted, then handed out, then received: per message, so in
    # total and at worst too.
    assert fired.total <= accepted.total <= handed_out.total <= sum(received)
    assert fired.max <= accepted.max <= handed_out.max <= max(received)
