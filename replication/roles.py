"""A member's role, as the metaserver names it: one session at a time, replaced when the word changes.

Both server kinds with replicated groups (scheduler, realtime) run the same loop: the
metaserver says master or slave, of which epoch, following which master
(``Registration.view()``); ``RoleLoop`` runs the session that word calls for and ends
it when the role, the epoch or the master changes, or at once when the member learns
it was fenced (``kick``). ``Mastership`` catches the other way a master goes stale:
its process was frozen (SIGSTOP) or starved past the failover time, so it confirms
with the metaserver before it accepts or sends anything again.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Generic, Protocol, TypeVar

import trio

from delaymq.client.membership import MembershipView
from delaymq.client.registration import Registration
from delaymq.clock import Clock
from delaymq.protocol.errors import RemoteProtocolError

log = logging.getLogger(__name__)

#: A master whose event loop did not run for this many heartbeat intervals past its
#: watchdog's moment (frozen, starved) confirms its mastership with the metaserver before
#: it goes on: a failover needs at least four intervals of silence (five, less the one
#: since its last heartbeat).
SUSPENDED_INTERVALS = 2
#: How long a member waits for the metaserver to name its role before it serves (refusing).
FIRST_ROLE_WAIT_S = 5.0
#: A graceful handover that has not finished by then is given up: the master serves again.
HANDOVER_TIMEOUT_S = 30.0


class Role(enum.StrEnum):
    """What a member reports as its role (STATUS, statistics, the metrics' ``is_master``).

    One meaning for every replicated server: ``MASTER`` only while it takes requests
    (a master session that is still taking over, handing over or was fenced is
    ``WAITING``, as is a member the metaserver has not named yet); ``SLAVE`` while it
    copies a master's log. The metaserver's word (``MembershipView.role``) is another
    thing: what the member is told to be, not what it does yet.
    """

    MASTER = "master"
    SLAVE = "slave"
    WAITING = "waiting"


class NotMaster(RemoteProtocolError):
    """A request only a master takes, at a member that is not (or no longer, or not yet) master."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="not_master")


class Session(Protocol):
    """A master or slave session: runs until cancelled."""

    @property
    def epoch(self) -> int: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...


S = TypeVar("S", bound=Session)


class RoleLoop(Generic[S]):
    """Runs the session the metaserver's word calls for (``session_for``); see the module docstring.

    ``between`` runs after a session ends and before the next starts (the owner waits
    there for writes the old session queued). Without a registration the member is
    master for good (``standalone``).
    """

    def __init__(
        self,
        *,
        session_for: Callable[[MembershipView], S | None],
        standalone: Callable[[], S],
        between: Callable[[S | None], Awaitable[None]],
    ) -> None:
        self._session_for = session_for
        self._standalone = standalone
        self._between = between
        self.session: S | None = None
        self._kick = trio.Event()

    def kick(self) -> None:
        """Look at the metaserver's word again now (this member was fenced)."""
        self._kick.set()

    async def run(
        self, registration: Registration | None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Reports started once the first role (master or slave) runs (or after ``FIRST_ROLE_WAIT_S`` without a
        word from the metaserver: the member then serves, refusing, until it comes)."""
        if registration is None:
            session = self._standalone()
            self.session = session
            await session.run(task_status=task_status)
            return
        started = False
        with trio.move_on_after(FIRST_ROLE_WAIT_S):
            await registration.wait_registered()
        view = registration.view()
        while True:
            async with trio.open_nursery() as nursery:
                run = self._session_for(view)
                if run is not None:
                    await nursery.start(self._run_session, run)
                if not started:
                    started = True
                    task_status.started()
                new = await self._next_view(registration, view)
                nursery.cancel_scope.cancel()
            self.session = None
            await self._between(run)
            view = new

    async def _run_session(self, session: S, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.session = session
        try:
            await session.run(task_status=task_status)
        except BaseException:
            if self.session is session:
                self.session = None
            raise

    async def _next_view(self, registration: Registration, view: MembershipView) -> MembershipView:
        """The metaserver's next word that changes the role, epoch or master; or the current
        word at once when this member was kicked (fenced)."""
        current = view
        while True:
            kick = self._kick
            changed = await first_of(partial(registration.wait_view_change, current), kick.wait)
            if changed is None:
                self._kick = trio.Event()
                return registration.view()
            if (changed.role, changed.epoch, changed.master_address) != (view.role, view.epoch, view.master_address):
                return changed
            current = changed


T = TypeVar("T")


async def first_of(wanted: Callable[[], Awaitable[T]], other: Callable[[], Awaitable[object]]) -> T | None:
    """``wanted()``'s result, or None if ``other()`` returns first (the loser is cancelled)."""
    result: list[T] = []
    async with trio.open_nursery() as nursery:

        async def run_wanted() -> None:
            result.append(await wanted())
            nursery.cancel_scope.cancel()

        async def run_other() -> None:
            await other()
            nursery.cancel_scope.cancel()

        nursery.start_soon(run_wanted)
        nursery.start_soon(run_other)
    return result[0] if result else None


class Handover:
    """A master's side of a graceful handover (``delaymq admin handover``).

    ``run`` carries out each handover the metaserver asks for (``handover_to``):
    ``hand_over(target)`` stops taking requests, drains and returns once the target holds
    everything; then ``handed_over`` is the epoch handed over (reported to the metaserver,
    which promotes the target: the role loop ends the session). A handover the metaserver
    drops, or one not finished within ``HANDOVER_TIMEOUT_S``, is undone (``resume``).
    """

    def __init__(
        self,
        *,
        what: str,
        epoch: int,
        hand_over: Callable[[str], Awaitable[None]],
        resume: Callable[[], None],
    ) -> None:
        self._what = what
        self._epoch = epoch
        self._hand_over = hand_over
        self._resume = resume
        self.handed_over: int | None = None

    async def run(self, registration: Registration) -> None:
        view = registration.view()
        while True:
            while not view.handover_to:
                view = await registration.wait_view_change(view)
            target = view.handover_to
            with trio.move_on_after(HANDOVER_TIMEOUT_S):
                async with trio.open_nursery() as nursery:

                    async def watch(seen: MembershipView = view, target: str = target) -> None:
                        while seen.handover_to == target:
                            seen = await registration.wait_view_change(seen)
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(watch)
                    log.warning("%s: handing over to %s: requests stopped, draining", self._what, target)
                    await self._hand_over(target)
                    self.handed_over = self._epoch
                    log.warning("%s: %s holds everything; handed over", self._what, target)
                    registration.heartbeat_now()
                    await trio.sleep_forever()  # the role loop ends this master role when the target is promoted
            view = registration.view()
            if view.role != "master" or view.epoch != self._epoch:
                await trio.sleep_forever()  # promoted the target: the role loop ends this master role
            log.warning("%s: handover to %s did not happen; serving again", self._what, target)
            self.handed_over = None
            self._resume()
            while view.handover_to == target:  # asked again only once the metaserver's word changes
                view = await registration.wait_view_change(view)


class Mastership:
    """Notices that this process was frozen or starved, and then re-confirms mastership.

    A watchdog wakes at the heartbeat interval the metaserver names (200 ms for a group
    that fails over after 1 s) and notes when it means to wake next; a request that
    finds that moment more than ``SUSPENDED_INTERVALS`` intervals past (the loop did not
    run) first asks the metaserver. Any freeze long enough for a failover spans several
    wake-ups, so it is always noticed; an idle master wakes once per interval.
    """

    def __init__(self, clock: Clock, registration: Registration | None, epoch: int) -> None:
        self._clock = clock
        self._registration = registration
        self._epoch = epoch
        self._deadline = clock.monotonic_ms()
        self._stalled_ms = 0  # how long the last stall the watchdog saw lasted (0: none pending)
        self._confirmed: trio.Event | None = None  # set when the confirmation under way ends
        self.confirmations = 0

    async def watch(self) -> None:
        registration = self._registration
        if registration is None:  # no metaserver: nobody can replace this master
            return
        while True:
            interval = max(registration.heartbeat_interval_ms, 1)
            self._deadline = self._clock.monotonic_ms() + interval
            await self._clock.sleep_ms(interval)
            late = self._clock.monotonic_ms() - self._deadline
            if late > self._suspended_ms():
                self._stalled_ms = max(self._stalled_ms, late)

    def _suspended_ms(self) -> int:
        assert self._registration is not None
        return SUSPENDED_INTERVALS * max(self._registration.heartbeat_interval_ms, 1)

    async def confirm(self) -> None:
        """Return at once unless the loop stalled past ``SUSPENDED_INTERVALS``; then only once the
        metaserver has answered again naming this member master of the same epoch."""
        registration = self._registration
        if registration is None:
            return
        stalled = max(self._stalled_ms, self._clock.monotonic_ms() - self._deadline)
        if stalled <= self._suspended_ms():
            return
        if self._confirmed is not None:  # another caller is asking already
            await self._confirmed.wait()
            return await self.confirm()
        self._confirmed = trio.Event()
        try:
            log.warning(
                "master did not run for %.1f s (frozen?): confirming mastership before going on", stalled / 1000
            )
            before = registration.last_answer_ms
            while registration.last_answer_ms == before:
                registration.heartbeat_now()
                await self._clock.sleep_ms(20)
            view = registration.view()
            if view.role != "master" or view.epoch != self._epoch:
                raise NotMaster(
                    f"this member is no longer master of epoch {self._epoch} (the metaserver says {view.role})"
                )
            self.confirmations += 1
            self._stalled_ms = 0
            self._deadline = self._clock.monotonic_ms()
        finally:
            self._confirmed.set()
            self._confirmed = None


__all__ = [
    "FIRST_ROLE_WAIT_S",
    "HANDOVER_TIMEOUT_S",
    "SUSPENDED_INTERVALS",
    "Handover",
    "Mastership",
    "NotMaster",
    "Role",
    "RoleLoop",
    "Session",
    "first_of",
]
