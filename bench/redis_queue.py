"""The yardstick of ``delaymq bench delay``: the same workload on a Redis sorted-set delay queue.

delaymq's goals (docs/performance.md, "Goals") are set against a Redis sorted-set delay
queue run on the same machine in the same invocation (these machines are noisy: ratios, not absolute
figures). The benchmark starts its own ``redis-server`` on loopback on a free port
with no persistence (``--save '' --appendonly no``: Redis accepts in memory, at
most once) and runs the delay workload against it as a real Redis delay queue
would be used:

- a producer adds batches of 1,000 members (a message id and a 100-byte body) with
  one ``ZADD`` each, score = due time in epoch ms;
- a consumer polls every ``POLL_INTERVAL_S`` with a Lua script that takes up to
  1,000 due members (``ZRANGEBYSCORE ... WITHSCORES LIMIT``) and removes them
  (``ZREM``) atomically, polling again at once while it gets full batches; popping
  is Redis's delivery and its ack (at most once), and the consumer "acks" each
  message by handling it (lateness, duplicates) as delaymq's bench consumer does.

Producer and consumer are two threads of this process, as delaymq's are two tasks
of one trio program; each run collects cycles as a server does (``tuned_collector``:
what the process held before the run frozen, the servers' thresholds), delaymq's too.
The ``redis`` client package (the ``dev`` extra) is imported only when the comparison
runs, so the installed command works without it.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from delaymq.net.serving import tuned_collector

#: How often the consumer asks for due members when the last poll found fewer than a batch.
POLL_INTERVAL_S = 0.005
POP_LIMIT = 1_000
KEY = "delayed"
#: A burst's Redis calls give up after this long (a stalled server fails the benchmark, never hangs it).
BURST_TIMEOUT_S = 30.0
#: Pops up to ARGV[2] members due by ARGV[1] (epoch ms) with their scores, atomically.
POP_DUE = """
local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local members = {}
for i = 1, #items, 2 do members[#members + 1] = items[i] end
if #members > 0 then redis.call('ZREM', KEYS[1], unpack(members)) end
return items
"""


@dataclass
class RedisRun:
    """What one run of the workload against Redis measured."""

    accepted: float  # msg/s the producer got answered
    lateness_ms: list[float]  # receive time - due time, per message received
    lost: int
    duplicated: int
    cpu_seconds: float  # redis-server's user + system CPU over the run
    peak_rss_mb: float
    seconds: float  # from the first ZADD to the last message received


def find_redis_server(*, install: bool) -> tuple[str | None, str]:
    """The ``redis-server`` program, installing Debian's package when allowed and root.

    Returns (path or None, why it is missing)."""
    path = shutil.which("redis-server")
    if path is not None:
        return path, ""
    if not install:
        return None, "redis-server is not installed (apt-get install redis-server)"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, "redis-server is not installed and this is not root with apt-get: apt-get install redis-server"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    attempts = (["apt-get", "install", "-y", "-q", "redis-server"],)
    for command in (*attempts, ["apt-get", "update", "-q"], *attempts):  # a stale package list: update, try again
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        path = shutil.which("redis-server")
        if path is not None:
            return path, ""
        if result.returncode != 0 and command[1] == "update":
            break
    return None, "apt-get install redis-server failed"


def redis_client_missing() -> str | None:
    """Why the ``redis`` client package cannot be used, or None."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis client package is not installed (pip install redis, or the dev extra)"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class RedisProcess:
    process: subprocess.Popen[bytes]
    port: int


@contextmanager
def redis_server(program: str, scratch: Path) -> Iterator[RedisProcess]:
    """A ``redis-server`` on 127.0.0.1 at a free port, no persistence; stopped at the end."""
    import redis

    scratch.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    process = subprocess.Popen(
        [program, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(scratch), "--daemonize", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)  # waiting for a child to listen, not synchronising a test
        client.close()
        yield RedisProcess(process, port)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    """A live process's high-water resident set (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_delay_queue(
    server: RedisProcess, *, count: int, delay_range: tuple[float, float], batch: int = 1_000, seed: int = 7
) -> RedisRun:
    """``count`` messages of 100 bytes due at now + uniform(delay_range) seconds, through Redis."""
    import redis

    sent: set[str] = set()
    received: dict[str, int] = {}
    lateness: list[float] = []
    duplicated = 0
    all_in = threading.Event()
    producer_done = threading.Event()
    errors: list[BaseException] = []
    accepted = 0.0

    def produce() -> None:
        nonlocal accepted
        client = redis.Redis(host="127.0.0.1", port=server.port)
        try:
            accepted = zadd_all(client, count=count, delay_range=delay_range, batch=batch, seed=seed, sent=sent)
        except BaseException as error:  # reported by the caller
            errors.append(error)
            all_in.set()
        finally:
            producer_done.set()
            client.close()

    def consume() -> None:
        nonlocal duplicated
        client = redis.Redis(host="127.0.0.1", port=server.port)
        pop_due = client.register_script(POP_DUE)
        try:
            while not all_in.is_set():
                items = pop_due(keys=[KEY], args=[int(time.time() * 1000), POP_LIMIT])
                received_ms = time.time() * 1000
                for index in range(0, len(items), 2):  # each message "acked" by handling it
                    message_id = items[index][:32].decode()
                    lateness.append(received_ms - float(items[index + 1]))
                    if message_id in received:
                        duplicated += 1
                    received[message_id] = 1
                if len(received) >= count:
                    all_in.set()
                elif len(items) < 2 * POP_LIMIT:
                    time.sleep(POLL_INTERVAL_S)  # a real delay queue's poll interval
        except BaseException as error:  # reported by the caller
            errors.append(error)
            all_in.set()
        finally:
            client.close()

    cpu_before = cpu_seconds(server.process.pid)
    started = time.perf_counter()
    threads = [threading.Thread(target=produce, daemon=True), threading.Thread(target=consume, daemon=True)]
    for thread in threads:
        thread.start()
    producer_done.wait()
    all_in.wait(timeout=delay_range[1] + 30)
    all_in.set()  # the consumer stops either way
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"the Redis run failed: {errors[0]!r}") from errors[0]
    return RedisRun(
        accepted=accepted,
        lateness_ms=lateness,
        lost=len(sent - received.keys()),
        duplicated=duplicated,
        cpu_seconds=cpu_seconds(server.process.pid) - cpu_before,
        peak_rss_mb=peak_rss_mb(server.process.pid),
        seconds=seconds,
    )


def zadd_all(
    client: Any, *, count: int, delay_range: tuple[float, float], batch: int, seed: int, sent: set[str]
) -> float:
    """The producer's part: ``count`` members (an id and a 100-byte body, due at now +
    uniform(delay_range) s) in one ``ZADD`` per ``batch``, their ids into ``sent``; returns
    the msg/s accepted, from the first ``ZADD`` to the last answer."""
    body = "x" * 100
    rng = random.Random(seed)
    started = time.perf_counter()
    for first in range(0, count, batch):
        now_ms = time.time() * 1000
        members: dict[str, float] = {}
        for _ in range(min(batch, count - first)):
            members[f"{uuid.uuid4().hex}:{body}"] = int(now_ms + rng.uniform(*delay_range) * 1000)
        client.zadd(KEY, members)
        sent.update(member[:32] for member in members)
    return count / (time.perf_counter() - started)


def accept_burst(server: RedisProcess, *, count: int, delay_range: tuple[float, float], seed: int = 7) -> float:
    """The producer's part into an empty queue (emptied again after), its consumer polling as in
    the full run (nothing falls due during a burst; the polls cost the producer's thread about
    5 % of its rate): msg/s accepted."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=BURST_TIMEOUT_S)
    poller = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=BURST_TIMEOUT_S)
    pop_due = poller.register_script(POP_DUE)
    done = threading.Event()
    errors: list[BaseException] = []

    def poll() -> None:
        try:
            while not done.is_set():
                pop_due(keys=[KEY], args=[int(time.time() * 1000), POP_LIMIT])
                done.wait(POLL_INTERVAL_S)
        except BaseException as error:  # reported by the burst
            errors.append(error)

    consumer = threading.Thread(target=poll, daemon=True)
    try:
        client.delete(KEY)
        consumer.start()
        with tuned_collector():
            accepted = zadd_all(client, count=count, delay_range=delay_range, batch=1_000, seed=seed, sent=set())
        done.set()
        consumer.join()
        if errors:
            raise RuntimeError(f"the Redis burst's consumer failed: {errors[0]!r}") from errors[0]
        client.delete(KEY)
        return accepted
    finally:
        done.set()
        client.close()
        poller.close()


def bench_redis_delay(
    scratch: Path, *, count: int, delay_range: tuple[float, float], install: bool
) -> tuple[RedisRun | None, str]:
    """The Redis run of the delay workload, or None and why it was skipped."""
    missing = redis_client_missing()
    if missing is not None:
        return None, missing
    program, why = find_redis_server(install=install)
    if program is None:
        return None, why
    with redis_server(program, scratch) as server:
        with tuned_collector():
            return run_delay_queue(server, count=count, delay_range=delay_range), ""


__all__ = [
    "POLL_INTERVAL_S",
    "accept_burst",
    "RedisProcess",
    "RedisRun",
    "bench_redis_delay",
    "cpu_seconds",
    "find_redis_server",
    "peak_rss_mb",
    "redis_server",
    "run_delay_queue",
    "zadd_all",
]
