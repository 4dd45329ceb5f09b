"""The member's session now, as request handlers, housekeeping and statistics see it.

``SessionRole.of`` tells a master session from a slave one (what the member runs, not the
``Role`` it reports: a master session that does not take requests reports ``waiting``);
``CurrentSession`` gives the handlers the master session taking requests (the shell,
``ReplicatedServer.taking_requests``, refuses ``not_master`` otherwise) and what they
share after an append: the unfiled tail, replication, and the check that the member is
still master once the write is done.
"""

from __future__ import annotations

from dataclasses import dataclass

from delaymq.replication.roles import NotMaster
from delaymq.replication.shell import ReplicatedServer
from delaymq.scheduler.cancels import ScheduledBatch, TailEntry
from delaymq.scheduler.dispatcher import Dispatcher
from delaymq.scheduler.roles import MasterSession, Member, SlaveSession
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.writer import LogWriter

#: A member's session: master or slave of its group for one epoch.
Session = MasterSession | SlaveSession


@dataclass(frozen=True, slots=True)
class SessionRole:
    """A session seen by its kind: at most one of ``master`` and ``slave`` is set."""

    master: MasterSession | None = None
    slave: SlaveSession | None = None

    @classmethod
    def of(cls, session: Session | None) -> SessionRole:
        if isinstance(session, MasterSession):
            return cls(master=session)
        if isinstance(session, SlaveSession):
            return cls(slave=session)
        return cls()

    @property
    def epoch(self) -> int:
        """The group epoch of the session (0: none, or standalone)."""
        session = self.master or self.slave
        return session.epoch if session is not None else 0


class CurrentSession:
    """The session the shell's role loop runs now, and the master's side of a request's write."""

    def __init__(
        self,
        member: Member,
        shell: ReplicatedServer[MasterSession, SlaveSession],
        *,
        idle_wheels: WheelSet,
        idle_dispatcher: Dispatcher,
        replication_timeout_ms: int,
    ) -> None:
        self.member = member
        self._shell = shell
        # What a member that is not master shows: empty wheels, a dispatcher that never ran.
        self._idle_wheels = idle_wheels
        self._idle_dispatcher = idle_dispatcher
        self.replication_timeout_ms = replication_timeout_ms

    @property
    def session(self) -> Session | None:
        return self._shell.session

    @property
    def role(self) -> SessionRole:
        return SessionRole.of(self._shell.session)

    @property
    def group(self) -> str:
        return self.member.group

    @property
    def address(self) -> str:
        return self.member.address

    @property
    def store(self) -> ScheduleStore:
        """The schedule store open now (a cut-back opens it again)."""
        return self.member.store

    @property
    def writer(self) -> LogWriter:
        """The message log's writer (open while the member serves)."""
        writer = self.member.writer
        assert writer is not None
        return writer

    @property
    def wheels(self) -> WheelSet:
        master = self.role.master
        return master.wheels if master is not None else self._idle_wheels

    @property
    def dispatcher(self) -> Dispatcher:
        master = self.role.master
        if master is not None and master.dispatcher is not None:
            return master.dispatcher
        return self._idle_dispatcher

    def taking_requests(self, what: str) -> MasterSession:
        """The master session now, accepting requests; ``NotMaster`` says why not."""
        return self._shell.taking_requests(what)

    def check_master(self, session: MasterSession, what: str) -> None:
        """Refuse ``what`` if ``session`` stopped being the accepting master while it waited."""
        if self.session is not session or not session.accepting:
            raise NotMaster(f"{what}: scheduler {self.address or '-'} stopped being master; ask the metaserver")

    async def logged(
        self,
        session: MasterSession,
        entries: list[tuple[str, TailEntry]] | ScheduledBatch,
        end: int,
        command: str,
        *,
        overlap: bool = True,
    ) -> None:
        """What a SCHEDULE, CANCEL or MOVE appended (up to ``end``): in the unfiled tail for
        replay, then replicated as the policy asks, before the answer. ``overlap`` False: no
        key of a SCHEDULE's batch was in the tail or came twice (``fresh_records``)."""
        session.tail.add(entries, end, overlap=overlap)
        session.source.poke()
        session.replay_alarm.poke()
        await session.source.confirm_replicated(
            end, timeout_ms=self.replication_timeout_ms, what=f"{command} at {self.address or '-'}"
        )
        if self.session is not session:
            raise NotMaster(f"{command}: scheduler {self.address or '-'} stopped being master while the write waited")


__all__ = ["CurrentSession", "Session", "SessionRole"]
