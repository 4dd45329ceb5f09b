"""A scheduler's periodic work: deleting what is no longer needed, saving its counters.

**cleanup** (every ``cleanup_interval_ms``) deletes message-log segments below the
replay checkpoint and hours fully delivered longer than ``retention_ms`` ago; a master
rolls its active segment first if it holds filed records, so the message log holds
little more than what is not yet filed. Between rounds, while the server is busy,
segments are deleted as soon as they are filed and the counters (totals since the
folder was created) are saved in lmdb, at most once a second (``COUNTERS_SAVE_MS``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from delaymq.clock import Alarm
from delaymq.scheduler.counters import SchedulerCounters
from delaymq.scheduler.current import CurrentSession
from delaymq.scheduler.hours import ScheduleError, hour_name
from delaymq.storage.errors import StorageError

log = logging.getLogger(__name__)

#: While counters change they are saved at most this often (one small lmdb transaction).
COUNTERS_SAVE_MS = 1_000


class Housekeeping:
    """Runs cleanup, deletes filed segments and saves the counters (``run``); ``wake`` it when
    something may have changed the counters or filed a segment."""

    def __init__(
        self,
        *,
        current: CurrentSession,
        retention_ms: int,
        cleanup_interval_ms: int,
        counters: Callable[[], SchedulerCounters],
        saved: SchedulerCounters,
        save: Callable[[SchedulerCounters], None],
    ) -> None:
        self._current = current
        self._member = current.member
        self._retention_ms = retention_ms
        self._cleanup_interval_ms = cleanup_interval_ms
        self._counters = counters
        self._saved_counters = saved  # what lmdb holds now
        self._save = save  # blocking
        self._counters_failing = False
        self._alarm = Alarm(self._member.clock)
        self._idle = False
        self.deleted_hours = 0
        self.deleted_segments = 0

    def counters(self) -> SchedulerCounters:
        """This process's share of the totals."""
        return SchedulerCounters(deleted_hours=self.deleted_hours, deleted_segments=self.deleted_segments)

    def wake(self) -> None:
        """Something may have changed the counters or filed a segment: wake the idle housekeeper."""
        if self._idle:
            self._idle = False
            self._alarm.poke()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """``cleanup`` every ``cleanup_interval_ms`` (the hours' check runs only then); in
        between, while there is work (SCHEDULE, dispatch rounds and session changes wake it),
        at most once a second: delete the segments replay has filed and save the counters
        if they changed. Idle, it sleeps until woken or the next cleanup."""
        task_status.started()
        clock = self._member.clock
        next_cleanup = clock.monotonic_ms() + self._cleanup_interval_ms
        failing = False
        while True:
            now = clock.monotonic_ms()
            try:
                if now >= next_cleanup:
                    next_cleanup = now + self._cleanup_interval_ms
                    await self.cleanup()
                else:
                    await self._delete_filed_segments()
            except StorageError as error:  # a disk error (or a full disk): the next round tries again
                if not failing:
                    log.warning("scheduler %s: cleanup failed, trying again: %s", self._member.group, error)
                failing = True
            else:
                if failing:
                    log.info("scheduler %s: cleanup works again", self._member.group)
                failing = False
            changed = await self._save_counters()
            # Something moved this second, or a rolled segment waits for replay (or a slave):
            # look again in a second; otherwise sleep until woken or the next cleanup.
            busy = changed or failing or len(self._member.log.segments()) > 1
            wait = next_cleanup - clock.monotonic_ms()
            if busy:
                wait = min(wait, COUNTERS_SAVE_MS)
            self._idle = not busy
            await self._alarm.wait_ms(max(0, wait))
            self._idle = False

    async def cleanup(self) -> tuple[int, list[int]]:
        """Delete message-log segments below the checkpoint (and what slaves still need)
        and hours past retention. Returns (segments deleted, hours deleted). Hours the
        wheels still hold are kept.

        A master first rolls its active segment when that holds filed records (a small
        load may take days to fill one), so they go now, or once replay has filed the
        rest of it (``_delete_filed_segments``). A slave does not: its tail may yet have
        to be cut back when its master changes."""
        member = self._member
        now = member.clock.now_ms()
        keep = set(self._current.wheels.hours())
        below = self._deletable_below()
        if self._current.role.master is not None:
            base, size = member.log.segments()[-1]
            if size and base < below:
                await member.run_blocking(member.log.roll)
        segments, hours = await member.run_blocking(partial(self._delete_old, now, keep, below))
        self.deleted_segments += segments
        self.deleted_hours += len(hours)
        if segments or hours:
            log.info(
                "scheduler %s: deleted %d message-log segment(s) below offset %d and %d hour(s) "
                "delivered more than %.0f h ago: %s",
                member.group,
                segments,
                below,
                len(hours),
                self._retention_ms / 3_600_000,
                " ".join(hour_name(hour) for hour in hours) or "-",
            )
        return segments, hours

    def _deletable_below(self) -> int:
        """The message-log offset below which every record is filed and no slave heard from
        lately still needs it: segments wholly below it may go."""
        below = self._member.store.checkpoint
        master = self._current.role.master
        if master is not None:
            needed = master.source.retain_from()
            if needed is not None:
                below = min(below, needed)
        return below

    async def _delete_filed_segments(self) -> int:
        """Delete the segments wholly below ``_deletable_below`` (nothing to do: no thread call)."""
        below = self._deletable_below()
        message_log = self._member.log
        segments = message_log.segments()
        if len(segments) < 2 or sum(segments[0]) > below:
            return 0
        deleted: int = await self._member.run_blocking(partial(message_log.delete_before, below))
        self.deleted_segments += deleted
        return deleted

    async def _save_counters(self) -> bool:
        """Save the counters in the lmdb state if they changed since the last save; True if they had."""
        counters = self._counters()
        if counters == self._saved_counters:
            return False
        group = self._member.group
        try:
            await self._member.run_blocking(partial(self._save, counters))
        except StorageError as error:  # a full disk: kept in memory, saved once it has room
            if not self._counters_failing:
                log.warning("scheduler %s: cannot save its counters, trying again: %s", group, error)
            self._counters_failing = True
            return True
        if self._counters_failing:
            log.info("scheduler %s: counters saved again", group)
        self._counters_failing = False
        self._saved_counters = counters
        return True

    def _delete_old(self, now_ms: int, keep: set[int], below: int) -> tuple[int, list[int]]:
        """Delete the log's segments below ``below`` and the hours past retention not in ``keep``. Blocking."""
        store = self._member.store
        segments = self._member.log.delete_before(below)
        deleted = []
        for hour in store.hours_to_delete(now_ms, retention_ms=self._retention_ms):
            if hour in keep:
                continue
            try:
                store.delete_hour(hour)
            except ScheduleError as error:  # being filed into right now: next time
                log.info("scheduler %s: hour %s not deleted now: %s", self._member.group, hour_name(hour), error)
                continue
            deleted.append(hour)
        return segments, deleted


__all__ = ["COUNTERS_SAVE_MS", "Housekeeping"]
