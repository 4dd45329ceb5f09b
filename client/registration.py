"""What every server runs to stay known to the metaserver: register, then heartbeat.

A client of the metaserver like the route client, so it lives with the clients:
the scheduler and the realtime server reach the metaserver only through it.

``run_registration`` registers the server, heartbeats at the interval the
metaserver's answer names, registers again when the metaserver says it does not
know the server (``register_first``: it restarted without its data) or after an
outage, and while the metaserver is down retries with a growing backoff, logging
once per outage rather than once per attempt. The latest answer (the group's
state, its master, the route version) is held by a ``Registration``.
``start_registration`` is how a server starts it: as its group's master, with
its ``software_version()``.

Each run registers with an ``incarnation``, a token new at every start: it tells
the metaserver a restarted server (registered at once, superseding its group's
old master) from a deposed one still running (refused as ``superseded``, and
left unrouted, so two live masters never take turns). The heartbeat schedule and
the backoffs are intervals of the monotonic clock: a wall-clock step neither
stops nor rushes them.

A server of a replicated (managed) group also sends its ``member`` id (its data
folder's) and, from a ``replica()`` callable read right before each request, the
state of its copy; the metaserver then decides its role and answers it with the
group's epoch. The server watches those through ``Registration.view()`` and
``wait_view_change``, and asks for an early heartbeat with ``heartbeat_now``
(its in-sync set shrank, a handover drained, a fencing refusal was met), so the
metaserver hears of it at once rather than an interval later.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from typing import Any

import trio

from delaymq.client.membership import MembershipView, membership_fields, recorded_in_sync
from delaymq.clock import Clock
from delaymq.net.connection import TransportError
from delaymq.net.peers import AsyncCaller
from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.routes import MEMBER_TAKEN, REGISTER_FIRST, ROLE_MASTER, SUPERSEDED, ServerKind

log = logging.getLogger(__name__)

#: The register fields a server sends (``version`` is its software version); an
#: ``incarnation`` is added when absent.
INFO_FIELDS = ("group", "kind", "role", "address", "version")
#: The interval used until the metaserver names one.
DEFAULT_INTERVAL_MS = 5_000
#: The heartbeat interval while this member is in a hurry to hear the metaserver's next word
#: (``hurry``: its master is unreachable, or a handover to it is under way), for at most
#: ``HURRY_INTERVALS`` ordinary intervals: it learns of its promotion within this much.
HURRY_INTERVAL_MS = 25
HURRY_INTERVALS = 10

#: Reads a server's replica state (``offset``, ``epoch``, ``mode``, ``in_sync``,
#: ``handed_over``) right before each REGISTER and HEARTBEAT.
ReplicaState = Callable[[], Mapping[str, Any]]


class RegistrationRefused(Exception):
    """The metaserver refused the first registration: the server's settings are wrong."""


@dataclass(frozen=True, slots=True)
class RegistrationStatistics:
    registered: bool  # the latest attempt was answered
    state: str | None  # the group's state: "RW", "R" or "NRW"; None before any answer
    master_address: str | None  # the group's master, as the metaserver sees it
    route_version: int | None
    heartbeat_interval_ms: int
    meta_address: str  # the metaserver asked last
    registrations: int  # REGISTER answered
    heartbeats: int  # HEARTBEAT answered
    failures: int  # attempts that got no answer or an error
    outages: int  # runs of failed attempts
    last_answer_ms: int | None
    role: str | None = None  # managed groups: what the metaserver says this server is
    epoch: int = 0  # managed groups: the group's epoch as last answered


class Registration:
    """The latest word from the metaserver about this server's group."""

    def __init__(self, info: Mapping[str, Any], *, interval_ms: int) -> None:
        missing = [name for name in INFO_FIELDS if name not in info]
        if missing:
            raise ValueError(f"info lacks {', '.join(missing)}; a server registers with {', '.join(INFO_FIELDS)}")
        self.info = dict(info)
        self.state: str | None = None
        self.master_address: str | None = None
        self.route_version: int | None = None
        self.heartbeat_interval_ms = interval_ms
        self.meta_address = ""
        self.registered = False
        self.last_answer_ms: int | None = None
        #: When the last answered request was sent (monotonic ms): the metaserver heard this server then.
        self.answered_sent_ms: int | None = None
        self.superseded = False  # another server registered as this group's master since
        self.role: str | None = None  # managed groups: what the metaserver says this server is
        self.epoch = 0  # managed groups: the group's epoch, the current master's term
        self.handover_to: str | None = None  # to the master and the target, while a handover is pending
        #: To the master: the group's in-sync set as the metaserver recorded it at ``epoch``.
        self.in_sync: tuple[str, ...] | None = None
        self._in_sync_changed = trio.Event()
        self._hurry_until_ms: int | None = None
        self._first_answer = trio.Event()
        self._view_changed = trio.Event()
        self._send_now = False
        self._pause: trio.CancelScope | None = None
        self._registrations = 0
        self._heartbeats = 0
        self._failures = 0
        self._outages = 0

    @property
    def is_master(self) -> bool:
        """Whether routes point at this server as its group's master (in a managed
        group: whether the metaserver last said it is the master)."""
        if self.role is not None:
            return self.role == ROLE_MASTER
        return not self.superseded and self.master_address == self.info["address"]

    async def wait_registered(self) -> None:
        """Return once the metaserver has answered a registration."""
        await self._first_answer.wait()

    def view(self) -> MembershipView:
        """The latest answer's role, epoch, master and pending handover."""
        return MembershipView(self.role, self.epoch, self.master_address, self.handover_to)

    async def wait_view_change(self, old: MembershipView) -> MembershipView:
        """Return the latest view once it differs from ``old`` (at once if it already does)."""
        while (view := self.view()) == old:
            await self._view_changed.wait()
        return view

    async def wait_in_sync_change(self, old: tuple[int, tuple[str, ...] | None]) -> tuple[int, tuple[str, ...]]:
        """The (epoch, recorded in-sync set) of the latest answer once it differs from ``old``."""
        while (self.epoch, self.in_sync) == old or self.in_sync is None:
            await self._in_sync_changed.wait()
        return self.epoch, self.in_sync

    def silent_ms(self, now_ms: int) -> int | None:
        """How long (monotonic ms) since the metaserver last heard this server and answered; None: never."""
        return None if self.answered_sent_ms is None else now_ms - self.answered_sent_ms

    def hurry(self, now_ms: int) -> None:
        """Heartbeat every ``HURRY_INTERVAL_MS`` until the role, epoch or master changes (or
        ``HURRY_INTERVALS`` ordinary intervals pass): this member expects the metaserver's word
        to change soon and should hear it at once (its master stopped answering)."""
        if self._hurry_until_ms is None:
            self._hurry_until_ms = now_ms + HURRY_INTERVALS * self.heartbeat_interval_ms
            self.heartbeat_now()

    def next_interval_ms(self, interval_ms: int, now_ms: int) -> int:
        """The wait until the next heartbeat: ``interval_ms``, or less while in a hurry."""
        if self._hurry_until_ms is not None and now_ms >= self._hurry_until_ms:
            self._hurry_until_ms = None
        hurried = self._hurry_until_ms is not None or (
            self.handover_to is not None and self.handover_to == self.info["address"]
        )
        return min(interval_ms, HURRY_INTERVAL_MS) if hurried else interval_ms

    def heartbeat_now(self) -> None:
        """Send the next heartbeat at once rather than at the interval (the replica state
        changed in a way the metaserver must hear of). Several calls before it goes out
        make one heartbeat."""
        self._send_now = True
        if self._pause is not None:
            self._pause.cancel()

    async def _wait_next(self, clock: Clock, duration_ms: int) -> None:
        """Sleep until the next attempt is due, or ``heartbeat_now`` asks for one."""
        if not self._send_now:
            with trio.CancelScope() as self._pause:
                await clock.sleep_ms(duration_ms)
            self._pause = None
        self._send_now = False

    def _accept(self, command: int, metadata: Mapping[str, Any], now_ms: int) -> None:
        state = metadata.get("state")
        master = metadata.get("master")
        version = metadata.get("route_version")
        interval = metadata.get("heartbeat_interval_ms")
        if not isinstance(state, str):
            raise RemoteProtocolError("heartbeat answer has no string 'state'", code="bad_metadata", field="state")
        if master is not None and not isinstance(master, str):
            raise RemoteProtocolError("heartbeat answer 'master' is not a string", code="bad_metadata", field="master")
        for name, value in (("route_version", version), ("heartbeat_interval_ms", interval)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RemoteProtocolError(f"heartbeat answer has no integer {name!r}", code="bad_metadata", field=name)
        assert isinstance(version, int) and isinstance(interval, int)  # checked just above
        role, epoch, handover_to = membership_fields(metadata)
        group = self.info["group"]
        if self.state is not None and state != self.state:
            log.info("group %s state changed %s -> %s", group, self.state, state)
        if self.state is not None and master != self.master_address:
            log.info("group %s master is now %s (was %s)", group, master, self.master_address)
        if role is not None and (role, epoch) != (self.role, self.epoch):
            log.info("%s is %s of group %s at epoch %d (master %s)", self.info["address"], role, group, epoch, master)
        before, in_sync_before = self.view(), (self.epoch, self.in_sync)
        self.state, self.master_address, self.route_version = state, master, version
        self.role, self.epoch, self.handover_to = role, epoch if role is not None else self.epoch, handover_to
        self.in_sync = recorded_in_sync(metadata)
        if self.view() != before:
            if (before.role, before.epoch, before.master_address) != (role, self.epoch, master):
                self._hurry_until_ms = None  # the word it hurried for came
            self._view_changed.set()
            self._view_changed = trio.Event()
        if (self.epoch, self.in_sync) != in_sync_before:
            self._in_sync_changed.set()
            self._in_sync_changed = trio.Event()
        if interval > 0:
            self.heartbeat_interval_ms = interval
        self.registered = True
        self.superseded = False
        self.last_answer_ms = now_ms
        if command == Command.REGISTER:
            self._registrations += 1
        else:
            self._heartbeats += 1
        self._first_answer.set()

    def statistics(self) -> RegistrationStatistics:
        return RegistrationStatistics(
            registered=self.registered,
            state=self.state,
            master_address=self.master_address,
            route_version=self.route_version,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            meta_address=self.meta_address,
            registrations=self._registrations,
            heartbeats=self._heartbeats,
            failures=self._failures,
            outages=self._outages,
            last_answer_ms=self.last_answer_ms,
            role=self.role,
            epoch=self.epoch,
        )


async def run_registration(
    peers: AsyncCaller,
    *,
    meta_address: str | Sequence[str],
    info: Mapping[str, Any],
    clock: Clock,
    interval_ms: int | None = None,
    backoff_initial_ms: int = 100,
    random: RandomSource | None = None,
    replica: ReplicaState | None = None,
    task_status: trio.TaskStatus[Registration] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep this server registered until cancelled.

    ``info`` holds ``group, kind, role, address, version`` (and ``member``, a
    replicated group's server's data-folder id). ``replica()``, when given, is
    called right before each REGISTER and HEARTBEAT for its ``replica`` field,
    which makes the group a managed one. ``interval_ms``
    overrides the heartbeat interval the metaserver names. ``nursery.start``
    returns the ``Registration`` after the first attempt, answered or not (a
    metaserver that is down must not keep a server from starting); a first
    attempt the metaserver refuses raises ``RegistrationRefused``. Several
    ``meta_address``es are tried in turn while one is unreachable. Without an
    ``incarnation`` in ``info``, a new one is drawn for this run. Failed attempts
    are retried after a backoff growing from ``backoff_initial_ms`` up to the
    heartbeat interval, jittered by ``random`` (tests fix it).
    """
    addresses = [meta_address] if isinstance(meta_address, str) else list(meta_address)
    if not addresses:
        raise ValueError("meta_address: at least one metaserver address is needed")
    registration = Registration(
        {"incarnation": secrets.token_hex(8), **info}, interval_ms=interval_ms or DEFAULT_INTERVAL_MS
    )
    attempts = _Attempts(
        registration, addresses, clock=clock, interval_ms=interval_ms, backoff_initial_ms=backoff_initial_ms,
        random=random, replica=replica,
    )  # fmt: skip
    while True:
        next_at = await attempts.attempt(peers)
        if next_at is None:
            continue  # the metaserver forgot this server: register at once
        if not attempts.started:
            attempts.started = True
            task_status.started(registration)
        await registration._wait_next(clock, next_at - clock.monotonic_ms())


class _Attempts:
    """The REGISTER and HEARTBEAT attempts of one ``run_registration``, and what they carry over:
    which metaserver is asked, which command is next, the backoff, the outage under way."""

    def __init__(
        self,
        registration: Registration,
        addresses: Sequence[str],
        *,
        clock: Clock,
        interval_ms: int | None,
        backoff_initial_ms: int,
        random: RandomSource | None,
        replica: ReplicaState | None,
    ) -> None:
        self.registration = registration
        self._addresses = addresses
        self._clock = clock
        self._interval_ms = interval_ms  # the caller's override of the metaserver's interval
        self._backoff_initial_ms = backoff_initial_ms
        self._replica = replica
        info = registration.info
        self._full = {name: info[name] for name in (*INFO_FIELDS, "incarnation", "member") if name in info}
        self._light = {"group": self._full["group"], "address": self._full["address"]}
        self._where = f"{self._full['address']} (group {self._full['group']})"
        self._current = 0  # index of the metaserver asked
        self._register = True  # REGISTER next (else HEARTBEAT)
        self.started = False  # the first attempt is over: ``task_status.started`` was called
        self._backoff = BackoffRun(_retry_policy(backoff_initial_ms, registration.heartbeat_interval_ms), random=random)
        self._outage_since: int | None = None
        self._refused: str | None = None  # the refusal last logged: a repeat is not logged again

    async def attempt(self, peers: AsyncCaller) -> int | None:
        """Send one REGISTER or HEARTBEAT; the monotonic ms the next one is due, or None for at once."""
        registration, clock = self.registration, self._clock
        address = self._addresses[self._current]
        registration.meta_address = address
        command = Command.REGISTER if self._register else Command.HEARTBEAT
        interval = self._interval_ms or registration.heartbeat_interval_ms
        sent_at = clock.monotonic_ms()  # an interval: never from the wall clock
        request = self._full if self._register else self._light
        if self._replica is not None:
            request = {**request, "replica": dict(self._replica())}
        try:
            frame = await peers.call(address, command, request, timeout=max(interval, 1_000) / 1000)
            registration._accept(command, frame.metadata, clock.now_ms())
        except PeerError as error:
            if error.code == REGISTER_FIRST and not self._register:
                log.info("metaserver %s does not know %s; registering again", address, self._where)
                self._register = True
                return None
            return self._refused_by(address, command, error, interval)
        except (TransportError, RemoteProtocolError) as error:
            return self._unreachable(address, error, interval)
        return self._answered(address, sent_at)

    def _refused_by(self, address: str, command: Command, error: PeerError, interval: int) -> int:
        registration = self.registration
        registration._failures += 1
        registration.registered = False
        registration.superseded = error.code == SUPERSEDED
        # A member id still live at its old address (a restart on a new one) waits for its
        # eviction like a metaserver outage; any other refusal at start is the operator's to fix.
        if not self.started and error.code != MEMBER_TAKEN:
            raise RegistrationRefused(f"metaserver {address} refused to register {self._where}: {error}") from error
        reason = str(error).removeprefix(f"{command.name}: ")  # the same refusal of either command
        if reason != self._refused:
            self._refused = reason
            log.error("metaserver %s refused %s of %s: %s", address, command.name, self._where, reason)
        self._register = True
        return self._clock.monotonic_ms() + _next_backoff_ms(self._backoff, self._backoff_initial_ms, interval)

    def _unreachable(self, address: str, error: Exception, interval: int) -> int:
        registration = self.registration
        registration._failures += 1
        registration.registered = False
        now = self._clock.monotonic_ms()
        if self._outage_since is None:
            self._outage_since = now
            registration._outages += 1
            log.warning("metaserver %s unreachable (%s); %s keeps retrying with backoff", address, error, self._where)
        self._register = True  # it may come back without its data: REGISTER says everything
        self._current = (self._current + 1) % len(self._addresses)
        return now + _next_backoff_ms(self._backoff, self._backoff_initial_ms, interval)

    def _answered(self, address: str, sent_at: int) -> int:
        registration = self.registration
        if self._outage_since is not None:
            log.info(
                "metaserver %s answers again after %.1f s; %s is %s",
                address,
                (self._clock.monotonic_ms() - self._outage_since) / 1000,
                self._where,
                "registered" if self._register else "heartbeating",
            )
        elif self._register:
            log.info(
                "registered %s with metaserver %s: group state %s, master %s%s",
                self._where,
                address,
                registration.state,
                registration.master_address,
                "" if registration.role is None else f", {registration.role} at epoch {registration.epoch}",
            )
        self._outage_since = None
        self._refused = None
        self._register = False
        registration.answered_sent_ms = sent_at
        self._backoff.reset()
        # At the interval this answer named, from the first one on: a replicated group's
        # master must not wait the default 5 s (its failover time) before its first heartbeat.
        interval = self._interval_ms or registration.heartbeat_interval_ms
        return sent_at + registration.next_interval_ms(interval, self._clock.monotonic_ms())


def _retry_policy(initial_ms: int, interval_ms: int) -> Backoff:
    """The retry policy of a registration: from ``initial_ms`` up to the heartbeat interval.

    "Equal" jitter: a wait is at least half its ceiling, so a server never retries
    in a tight loop against a metaserver that is down, while the servers that lost
    it together do not all come back to it at the same moment.
    """
    return Backoff(initial_ms=min(initial_ms, interval_ms), maximum_ms=interval_ms, jitter="equal")


def _next_backoff_ms(backoff: BackoffRun, initial_ms: int, interval_ms: int) -> int:
    """Count a failure; the wait before the next attempt (the metaserver may have named a new interval)."""
    if backoff.policy.maximum_ms != interval_ms:
        backoff.policy = _retry_policy(initial_ms, interval_ms)
    return backoff.next_delay_ms()


def software_version() -> str:
    """The installed delaymq's version, as a server registers it."""
    try:
        return metadata.version("delaymq")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


async def start_registration(
    nursery: trio.Nursery,
    peers: AsyncCaller,
    *,
    group: str,
    kind: ServerKind,
    address: str,
    meta_address: str | Sequence[str],
    clock: Clock,
    member: str | None = None,
    replica: ReplicaState | None = None,
) -> Registration:
    """Register ``group``'s master at ``address``, and keep heartbeating in ``nursery``.

    Returns after the first attempt, answered or not: a metaserver that is down
    does not keep the server from starting; one that refuses it does
    (``RegistrationRefused``). A replicated group's server passes its ``member``
    id and its ``replica`` state; it registers as master all the same, and the
    metaserver answers the role it gets (``Registration.role``).
    """
    info = {
        "group": group,
        "kind": kind.value,
        "role": ROLE_MASTER,
        "address": address,
        "version": software_version(),
    }
    if member is not None:
        info["member"] = member
    registration: Registration = await nursery.start(
        partial(run_registration, peers, meta_address=meta_address, info=info, clock=clock, replica=replica)
    )
    return registration


__all__ = [
    "INFO_FIELDS",
    "Registration",
    "RegistrationRefused",
    "RegistrationStatistics",
    "ReplicaState",
    "run_registration",
    "software_version",
    "start_registration",
]
