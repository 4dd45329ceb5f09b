"""The supervisor behind ``delaymq cluster``: restart waits, start failures, restarts on the
same address, the grace period before SIGKILL, what a child's output becomes.

The children here are small Python scripts standing in for servers: they announce an
address the way a server command logs it, then do what the test needs."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from delaymq.cli.supervisor import (
    RestartPolicy,
    StartFailed,
    Supervisor,
    describe_status,
    open_supervisor,
    spawn,
    wait_for_exit,
)
from delaymq.protocol.backoff import Backoff

#: A stand-in server: binds argv[1] (port 0: a free one), says so as a server command
#: does, logs a line at each level, then runs until signalled (argv[2] == "ignore-term":
#: it ignores SIGTERM; "exit": it exits at once with status 3).
FAKE_SERVER = """
import signal, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
listener = socket.create_server((host, int(port)))
stamp = "2026-11-22 10:00:00,000"
print(f"{stamp} DEBUG   fake: some detail", file=sys.stderr, flush=True)
print(f"{stamp} INFO    fake: fake server listening on {host}:{listener.getsockname()[1]} (data x)", flush=True)
print(f"{stamp} WARNING fake: a warning", file=sys.stderr, flush=True)
print("Traceback-like continuation of the warning", file=sys.stderr, flush=True)
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"{stamp} INFO    fake: ignoring SIGTERM", flush=True)
if sys.argv[2] == "exit":
    sys.exit(3)
while True:
    time.sleep(60)
"""


def fake(mode: str = "run") -> Callable[[str], list[str]]:
    """The command line of a stand-in server, as ``Supervisor.start`` takes it."""
    return lambda listen: [sys.executable, "-c", FAKE_SERVER, listen, mode]


def test_the_wait_before_a_restart_doubles_while_a_child_keeps_crashing_and_resets_after_a_healthy_run() -> None:
    policy = RestartPolicy(
        backoff=Backoff(initial_ms=250, maximum_ms=2_000, jitter="none"), healthy_after_s=30, random=lambda: 0.5
    )
    waits = []
    now = 0.0
    for _ in range(6):  # up one second each time, then down again
        policy.started(now)
        now += 1
        waits.append(policy.exited(now))
        now += waits[-1]
    assert waits == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert policy.quick_exits == 6
    policy.started(now)
    assert policy.exited(now + 30) == 0.25  # it ran long enough: a crash, not a crash loop


def test_an_exit_is_described_by_its_status_or_its_signal() -> None:
    assert describe_status(3) == "exit status 3"
    assert describe_status(-signal.SIGKILL) == "signal SIGKILL"


async def test_children_are_started_from_the_main_thread_only() -> None:
    # PR_SET_PDEATHSIG fires when the forking *thread* ends: a child forked in a worker
    # thread would be killed when that thread retires.
    with pytest.raises(RuntimeError, match="main thread"):
        await trio.to_thread.run_sync(spawn, [sys.executable, "-c", "pass"])
    process, output = spawn([sys.executable, "-c", "print('hi')"])
    received = b""
    async with output:
        while chunk := await output.receive_some():
            received += chunk
    assert received == b"hi\n"
    assert await wait_for_exit(process) == 0


async def test_a_child_that_exits_before_it_is_ready_fails_the_start_with_its_last_line() -> None:
    with trio.fail_after(30):
        async with open_supervisor(log_level=logging.WARNING) as supervisor:
            with pytest.raises(StartFailed) as failed:
                await supervisor.start(
                    "broken",
                    lambda _listen: [sys.executable, "-c", "import sys; sys.exit('no data folder')"],
                    listen="",
                )
    assert str(failed.value) == "broken exited with exit status 1 before it was ready: no data folder"


async def test_a_killed_child_is_reported_and_started_again_on_the_address_it_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forwarded: list[str] = []
    listens: list[str] = []

    def command(listen: str) -> list[str]:
        listens.append(listen)
        return fake()(listen)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            supervisor = Supervisor(nursery, log_level=logging.WARNING, output=forwarded.append)
            address = await supervisor.start("fake-1", command, listen="127.0.0.1:0")
            (child,) = supervisor.children
            assert child.process is not None
            first = child.process
            while "Traceback-like continuation of the warning" not in child.tail:
                await trio.sleep(0.01)  # polling the child's output, bounded by fail_after
            os.kill(first.pid, signal.SIGKILL)
            while child.process is first or "fake-1 is back" not in caplog.text:
                await trio.sleep(0.01)  # polling the supervisor's state, bounded by fail_after
            await supervisor.stop()
            nursery.cancel_scope.cancel()
    assert listens == ["127.0.0.1:0", address]  # the restart binds what the first start bound
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    report = next(r.getMessage() for r in caplog.records if "exited unexpectedly" in r.getMessage())
    assert report.startswith(f"fake-1 (pid {first.pid} on {address}) exited unexpectedly with signal SIGKILL")
    assert "on the same data and address. Its last lines:\n" in report
    assert report.endswith("    Traceback-like continuation of the warning")
    # Output at the supervisor's level or above is passed on, named; the tail kept everything.
    assert forwarded[:2] == [
        "[fake-1] 2026-11-22 10:00:00,000 WARNING fake: a warning\n",
        "[fake-1] Traceback-like continuation of the warning\n",
    ]
    assert not any("INFO" in line or "DEBUG" in line for line in forwarded)
    assert "2026-11-22 10:00:00,000 DEBUG   fake: some detail" in report


async def test_a_crash_at_once_after_each_start_is_started_again_and_again(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            supervisor = Supervisor(
                nursery,
                log_level=logging.ERROR,
                output=lambda _text: None,
                policy=lambda: RestartPolicy(backoff=Backoff(initial_ms=10, maximum_ms=40, jitter="none")),
            )
            await supervisor.start("crashing", fake("exit"), listen="127.0.0.1:0")
            (child,) = supervisor.children
            while child.restarts < 3:
                await trio.sleep(0.01)  # polling the supervisor's state, bounded by fail_after
            await supervisor.stop()
            nursery.cancel_scope.cancel()
    reports = [r.getMessage() for r in caplog.records if "unexpectedly" in r.getMessage()]
    assert len(reports) >= 3 and all(" exited unexpectedly with exit status 3; " in report for report in reports)


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with open_supervisor(log_level=logging.ERROR, grace_s=0.5) as supervisor:
            await supervisor.start("stubborn", fake("ignore-term"), listen="127.0.0.1:0", stage=1)
            await supervisor.start("polite", fake(), listen="127.0.0.1:0")
            stubborn, polite = supervisor.children
            assert stubborn.process is not None and polite.process is not None
            while "ignoring SIGTERM" not in "".join(stubborn.tail):
                await trio.sleep(0.01)  # polling the child's output, bounded by fail_after
    assert stubborn.process.returncode == -signal.SIGKILL
    assert polite.process.returncode == -signal.SIGTERM
    assert f"stubborn (pid {stubborn.process.pid}) has not stopped; killing it after 0.5 s" in caplog.text
    assert "unexpectedly" not in caplog.text  # stopped children are not restarted


async def test_a_second_stop_signal_kills_what_is_still_stopping(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            supervisor = Supervisor(nursery, log_level=logging.ERROR, grace_s=600, output=lambda _text: None)
            await supervisor.start("stubborn", fake("ignore-term"), listen="127.0.0.1:0")
            (child,) = supervisor.children
            while "ignoring SIGTERM" not in "".join(child.tail):
                await trio.sleep(0.01)  # polling the child's output, bounded by fail_after
            nursery.start_soon(supervisor.stop)  # SIGTERM, ignored; the grace period would be ten minutes
            supervisor.kill_now()  # what a second Ctrl-C does
            await child.exited.wait()
            nursery.cancel_scope.cancel()
    assert child.process is not None and child.process.returncode == -signal.SIGKILL
    assert f"stubborn (pid {child.process.pid}) has not stopped; killing it on a second stop signal" in caplog.text
