"""Supervising server processes: started, watched, restarted and stopped together.

``delaymq cluster`` runs each server as its own child process, the same
``delaymq metaserver|realtime|scheduler`` command a production deployment runs,
so no two servers share an interpreter. A ``Supervisor`` starts them and keeps
them running:

- a child is ready when it logs the address it bound (``... listening on
  HOST:PORT (...``); ``Supervisor.start`` returns that address;
- a child that exits when nobody asked it to is reported (its name, exit status
  and the last lines it wrote) and started again on the same data folder and the
  same address, after a wait that grows while it keeps crashing (``RestartPolicy``,
  the sans-IO part), so a crash loop does not spin;
- ``Supervisor.stop`` sends SIGTERM to the children (a later stage first: servers
  before the metaserver) and SIGKILL to any still running after a grace period (or
  at once on a second stop signal); it returns when all are gone;
- a child dies with its supervisor, however that dies (even SIGKILLed): each is
  started with ``PR_SET_PDEATHSIG`` = SIGKILL (Linux). That signal follows the
  *thread* that forked, not the process, and trio forks in worker threads that
  end when idle, so children are forked here, in the main thread, with
  ``subprocess.Popen`` (a few milliseconds), and waited for through a pidfd.

Each child runs in a process group of its own, so a Ctrl-C at the terminal
reaches the supervisor only, which stops them in order. What a child writes (it
logs at ``info`` at least, to announce its address) is forwarded to standard
error line by line, prefixed with its name, when at or above the supervisor's
log level.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource

log = logging.getLogger("delaymq.cluster")

#: How long stopped children get to stop before they are killed.
STOP_GRACE_S = 10.0
#: Lines of a child's output kept for the report of its unexpected exit.
TAIL_LINES = 20
#: What a server command logs once it serves: ``... listening on HOST:PORT (...``.
ANNOUNCEMENT = re.compile(rb" listening on (\S+) \(")
#: The level field of a log line (``delaymq.cli.main.setup_logging``'s format).
LOG_LINE = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ +\S+: ")
LEVELS = {b"DEBUG": logging.DEBUG, b"INFO": logging.INFO, b"WARNING": logging.WARNING, b"ERROR": logging.ERROR}
PR_SET_PDEATHSIG = 1
#: Waits before restarting a child that keeps exiting: 125-250 ms, doubling up to 15-30 s.
RESTART_BACKOFF = Backoff(initial_ms=250, maximum_ms=30_000, jitter="equal")


class StartFailed(Exception):
    """A child exited before it announced its address (so the cluster cannot start)."""

    def __init__(self, name: str, status: str, tail: Sequence[str]) -> None:
        last = _LOG_PREFIX.sub("", tail[-1]) if tail else "(no output)"
        super().__init__(f"{name} exited with {status} before it was ready: {last}")
        self.name = name
        self.tail = list(tail)


class RestartPolicy:
    """How long to wait before starting a child again that exited unexpectedly.

    A child that ran ``healthy_after_s`` or longer is started again after the
    first wait of ``backoff`` (a fraction of a second); each quicker exit after
    that doubles the wait, up to ``backoff.maximum_ms``. Fed times (seconds of
    any monotonic clock); reads none.
    """

    def __init__(
        self,
        *,
        backoff: Backoff = RESTART_BACKOFF,
        healthy_after_s: float = 30.0,
        random: RandomSource | None = None,
    ) -> None:
        self._run = BackoffRun(backoff, random=random)
        self._healthy_after_s = healthy_after_s
        self._started_at: float | None = None

    def started(self, now: float) -> None:
        self._started_at = now

    def exited(self, now: float) -> float:
        """The child exited at ``now``: seconds to wait before starting it again."""
        if self._started_at is not None and now - self._started_at >= self._healthy_after_s:
            self._run.reset()
        return self._run.next_delay_ms() / 1000

    @property
    def quick_exits(self) -> int:
        """Exits in a row, each within ``healthy_after_s`` of its start (or the first after a healthy run)."""
        return self._run.failures


def describe_status(returncode: int) -> str:
    """``exit status 1`` or ``signal SIGKILL``: how a child ended."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


_PRCTL = _load_prctl()


def _die_with(parent: int) -> Callable[[], None]:
    """What a child runs between fork and exec: SIGKILL when ``parent``'s forking thread ends."""
    prctl = _PRCTL

    def die_with_parent() -> None:
        if prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before the line above: nobody is left to stop it
            os._exit(1)

    return die_with_parent


def spawn(
    command: Sequence[str], *, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], trio.lowlevel.FdStream]:
    """Start ``command`` as a child that dies with this process; its output (stdout and stderr) as a stream.
    ``env``: variables set for the child on top of this process's environment (a secret that must not
    be on its command line, which ``ps`` shows).

    Must run in the main thread (see the module's docstring)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "children must be started from the main thread: PR_SET_PDEATHSIG kills them when the thread "
            "that forked them ends, and worker threads end when idle"
        )
    reader, writer = os.pipe()  # both ends close on exec; the child gets ``writer`` as its stdout and stderr
    try:
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **env} if env else None,
            stdin=subprocess.DEVNULL,
            stdout=writer,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=_die_with(os.getpid()),  # runs no import and takes no lock: safe after fork
        )
    except BaseException:
        os.close(reader)
        raise
    finally:
        os.close(writer)
    return process, trio.lowlevel.FdStream(reader)


async def wait_for_exit(process: subprocess.Popen[bytes]) -> int:
    """The child's exit status, once it has exited (through a pidfd: no thread, no polling)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux, or already reaped
        return await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        trio.lowlevel.notify_closing(pidfd)
        os.close(pidfd)
    return process.wait()


@dataclass
class Child:
    """One supervised server: its name, how to run it on an address, and its current process."""

    name: str
    command: Callable[[str], list[str]]
    listen: str
    stage: int = 0
    #: Variables set in its environment on top of the supervisor's (its token: never on its command line).
    env: Mapping[str, str] = field(default_factory=dict)
    #: The address it announced on its first start (then its ``listen`` for every restart).
    address: str | None = None
    process: subprocess.Popen[bytes] | None = None
    #: Whether the current process has announced its address.
    serving: bool = False
    exited: trio.Event = field(default_factory=trio.Event)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    restarts: int = 0


class Supervisor:
    """The children of one cluster, supervised in a nursery (see the module's docstring)."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        log_level: int,
        grace_s: float = STOP_GRACE_S,
        policy: Callable[[], RestartPolicy] = RestartPolicy,
        output: Callable[[str], object] | None = None,
    ) -> None:
        self._nursery = nursery
        self._log_level = log_level
        self._grace_s = grace_s
        self._policy = policy
        self._output = output if output is not None else _write_stderr
        self.children: list[Child] = []
        self._stopping = False
        self._kill_now = trio.Event()
        #: The signal ``stop_on`` saw first, if any.
        self.stopped_by: int | None = None

    async def start(
        self,
        name: str,
        command: Callable[[str], list[str]],
        *,
        listen: str,
        stage: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Start ``command(listen)`` as ``name`` (with ``env`` added to its environment) and supervise it;
        the address it bound.

        ``stop`` stops a later ``stage`` first (servers before the metaserver they
        report to). Raises ``StartFailed`` if the child exits before announcing an
        address (a port in use, a locked data folder: its last line says)."""
        child = Child(name, command, listen, stage, dict(env or {}))
        self.children.append(child)
        await self._nursery.start(self._supervise, child)
        if child.address is None:
            self.children.remove(child)
            status = describe_status(child.process.returncode if child.process else -1)
            raise StartFailed(name, status, child.tail)
        return child.address

    def stop_on(self, signals: AsyncIterator[int], serving: trio.CancelScope) -> None:
        """Watch ``signals`` (``trio.open_signal_receiver``): the first cancels ``serving`` (whose end
        stops the children), a later one kills whatever is still running. Sets ``stopped_by``."""
        self._nursery.start_soon(self._watch_signals, signals, serving)

    async def _watch_signals(self, signals: AsyncIterator[int], serving: trio.CancelScope) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if self.stopped_by is None:
                log.info("stopping on %s", name)
                self.stopped_by = signum
                serving.cancel()
            else:
                log.warning("%s again: killing the servers still running", name)
                self.kill_now()

    def kill_now(self) -> None:
        """Cut a running ``stop`` short: SIGKILL whatever is still running (a second Ctrl-C)."""
        self._kill_now.set()

    async def stop(self) -> None:
        """SIGTERM the children, a later stage first (one stage's at once); SIGKILL any still up after the grace period."""
        self._stopping = True
        for stage in sorted({child.stage for child in self.children}, reverse=True):
            async with trio.open_nursery() as nursery:
                for child in self.children:
                    if child.stage == stage:
                        nursery.start_soon(self._stop_one, child)

    async def _stop_one(self, child: Child) -> None:
        process = child.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(self._grace_s) as grace:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_when, self._kill_now, nursery.cancel_scope)
                await child.exited.wait()
                nursery.cancel_scope.cancel()
        if not child.exited.is_set():
            why = "on a second stop signal" if not grace.cancelled_caught else f"after {self._grace_s:g} s"
            log.warning("%s (pid %d) has not stopped; killing it %s", child.name, process.pid, why)
            process.send_signal(signal.SIGKILL)
            await child.exited.wait()

    async def _supervise(self, child: Child, *, task_status: trio.TaskStatus[None]) -> None:
        """Run ``child`` until stopped: start it, forward its output, start it again when it exits."""
        policy = self._policy()
        ready = False
        while not self._stopping:  # checked right before each start: ``stop`` never misses a child
            try:
                process, output = spawn(child.command(child.address or child.listen), env=child.env)
            except OSError as error:  # out of processes or descriptors: a crash like any other, once serving
                if not ready:
                    raise
                delay = policy.exited(trio.current_time())
                log.error("cannot start %s again (%s); trying again in %.1f s", child.name, error, delay)
                await trio.sleep(delay)
                continue
            child.process, child.exited = process, trio.Event()
            policy.started(trio.current_time())
            child.serving = False
            child.tail.clear()  # a report shows this run's last lines
            settled = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._forward, child, output, settled)
                    nursery.start_soon(self._watch_exit, child)
                    await settled.wait()  # it announced its address, or its output ended (it exited first)
                    if child.serving and not ready:
                        ready = True
                        task_status.started()
                    elif child.serving:
                        log.warning("%s is back (pid %d on %s)", child.name, process.pid, child.address)
            finally:
                if process.returncode is None:  # cancelled (the cluster failed): do not leave it behind
                    process.kill()
                    with trio.CancelScope(shield=True):
                        await wait_for_exit(process)
            if not ready:
                task_status.started()  # ``start`` sees no address and raises
                return
            if self._stopping:
                return
            delay = policy.exited(trio.current_time())
            log.error(
                "%s (pid %d on %s) exited unexpectedly with %s; starting it again in %.1f s on the same data "
                "and address. Its last lines:\n%s",
                child.name,
                process.pid,
                child.address,
                describe_status(process.returncode),
                delay,
                "\n".join(f"    {line}" for line in child.tail) or "    (none)",
            )
            child.restarts += 1
            await trio.sleep(delay)

    async def _watch_exit(self, child: Child) -> None:
        assert child.process is not None
        await wait_for_exit(child.process)
        child.exited.set()

    async def _forward(self, child: Child, output: trio.lowlevel.FdStream, settled: trio.Event) -> None:
        """Read the child's output to its end: keep a tail, learn its address, pass lines on.

        Sets ``settled`` when the child announces its address (``child.serving``), or at the end."""
        prefix = f"[{child.name}] "
        shown = True
        pending = b""
        async with output:
            while True:
                chunk = await output.receive_some(65536)
                if chunk:
                    *lines, pending = (pending + chunk).split(b"\n")
                else:  # the end: the child has exited
                    lines, pending = ([pending] if pending else []), b""
                for line in lines:
                    level = LOG_LINE.match(line)
                    if level is not None:  # a continuation line (a traceback) goes where its log line went
                        shown = LEVELS.get(level[1], logging.CRITICAL) >= self._log_level
                    text = line.decode(errors="replace")
                    child.tail.append(text)
                    if shown:
                        self._output(prefix + text + "\n")
                    if not child.serving and (found := ANNOUNCEMENT.search(line)) is not None:
                        child.address = child.address or found[1].decode()
                        child.serving = True
                        settled.set()
                if not chunk:
                    settled.set()
                    return


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _write_stderr(text: str) -> None:
    """Pass a child's line on; with nobody reading any more (a closed pipe), drop it rather than stop."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


@asynccontextmanager
async def open_supervisor(*, log_level: int, grace_s: float = STOP_GRACE_S) -> AsyncIterator[Supervisor]:
    """A ``Supervisor`` whose children are all stopped (``stop``) when the block ends, however it ends."""
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(nursery, log_level=log_level, grace_s=grace_s)
        try:
            yield supervisor
        finally:
            with trio.CancelScope(shield=True):
                await supervisor.stop()
            nursery.cancel_scope.cancel()


__all__ = [
    "STOP_GRACE_S",
    "Child",
    "RestartPolicy",
    "StartFailed",
    "Supervisor",
    "describe_status",
    "open_supervisor",
    "spawn",
    "wait_for_exit",
]
