"""``delaymq cluster``: the all-in-one local cluster, one process on loopback.

A metaserver, a realtime server and a scheduler, each
with its own folder under ``--data``; the embedded default a new user starts
with (``make run``). ``--replicas N`` gives the realtime group and the scheduler
group N slaves each (``DATA/realtime-1-replica-K``, ``DATA/scheduler-1-replica-K``)
with sync replication and min-insync 1. Stops cleanly on Ctrl-C or SIGTERM.

Each server keeps its address across restarts, so a restart is a pause and not a
move: clients' cached routes and the metaserver's registry stay right. An
address given with a port is used as given; one with port 0, or none (the
realtime server and the scheduler by default), is a free port chosen on the
first start. Either way the addresses bound are remembered in
``DATA/cluster-listen.json`` (``{"format": 1, "metaserver": "127.0.0.1:20880",
"realtime": "127.0.0.1:41735", "scheduler": "127.0.0.1:41737"}``) and used
again at the next start; a remembered port that something else has taken since
gives way to a new free one, with a warning.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import trio

from delaymq.cli import options
from delaymq.cli.serving import run_server, wait_for_stop_signal
from delaymq.client.producer import DEFAULT_META
from delaymq.metaserver.server import open_metaserver
from delaymq.protocol.errors import sole
from delaymq.protocol.transport import format_address, split_listen
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import open_scheduler
from delaymq.storage.format import write_json_atomically
from delaymq.storage.threads import run_in_thread
from delaymq.wheel.clock import SystemClock

log = logging.getLogger("delaymq.cluster")

#: Where the cluster remembers the addresses its servers bound (in ``--data``).
LISTEN_FILE = "cluster-listen.json"
LISTEN_FORMAT = 1
SERVERS = ("metaserver", "realtime", "scheduler")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="run a local all-in-one cluster (metaserver, realtime, scheduler) in one process",
        description=(
            "Run a metaserver, a realtime server and a scheduler in one process on loopback, "
            "each with its folder under --data. Producers and consumers use --meta-listen. "
            f"The addresses bound are kept in DATA/{LISTEN_FILE} and used again on restart."
        ),
    )
    parser.add_argument(
        "--data", type=Path, default=Path("var/cluster"), metavar="DIR", help="data folder (default: %(default)s)"
    )
    parser.add_argument(
        "--meta-listen",
        type=options.listen_address,
        default=DEFAULT_META,
        metavar="HOST:PORT",
        help="the metaserver's address, the one clients use; port 0: a free port chosen on the first "
        "start and kept (default: %(default)s)",
    )
    for name in ("realtime", "scheduler"):
        parser.add_argument(
            f"--{name}-listen",
            type=options.listen_address,
            metavar="HOST:PORT",
            help=f"the {name} server's address (default: a free port on 127.0.0.1, chosen on the first start and kept)",
        )
    parser.add_argument(
        "--flush",
        choices=("sync", "async"),
        default="sync",
        help="flush policy of the servers' logs (default: %(default)s)",
    )
    parser.add_argument(
        "--replicas",
        type=_replicas,
        default=0,
        metavar="N",
        help="slaves to run beside the realtime master and beside the scheduler master (data in "
        "DATA/realtime-1-replica-K and DATA/scheduler-1-replica-K); with one or more, replication is sync with "
        "min-insync 1 and the metaserver fails over to a slave (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def _replicas(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: --replicas takes a whole number from 0 to 8")
    return int(text)


def run(args: argparse.Namespace) -> int:
    return run_server(_serve, args, what=f"the local cluster with data {args.data}")


def read_listen_file(data: Path) -> dict[str, str]:
    """The addresses a previous start bound (empty if none, or if the file is unreadable)."""
    path = data / LISTEN_FILE
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("cannot read %s (%s); choosing the servers' ports again", path, error)
        return {}
    if not isinstance(stored, dict) or stored.get("format") != LISTEN_FORMAT:
        log.warning("%s is not a format-%d listen file; choosing the servers' ports again", path, LISTEN_FORMAT)
        return {}
    return {name: stored[name] for name in SERVERS if isinstance(stored.get(name), str)}


def choose_listen(asked: str | None, remembered: str | None) -> tuple[str, bool]:
    """Where a server listens, and whether that is a remembered address.

    An asked address with a port wins; otherwise the remembered one, if it is on
    the asked host (127.0.0.1 when nothing was asked); otherwise port 0.
    """
    host, port = split_listen(asked) if asked is not None else ("127.0.0.1", 0)
    if port:
        return format_address(host, port), False
    if remembered is not None:
        try:
            old_host, old_port = split_listen(remembered)
        except ValueError:
            old_host, old_port = "", 0
        if old_host == host and old_port:
            return format_address(host, old_port), True
    return format_address(host, 0), False


async def _enter_listening(
    stack: AsyncExitStack,
    name: str,
    asked: str | None,
    remembered: str | None,
    open_server: Callable[[str], AbstractAsyncContextManager[Any]],
) -> Any:
    """Open a server on its chosen address; a remembered port taken since gives way to a free one."""
    listen, is_remembered = choose_listen(asked, remembered)
    try:
        return await stack.enter_async_context(open_server(listen))
    except (OSError, BaseExceptionGroup) as raised:
        error = sole(raised)
        if not (is_remembered and isinstance(error, OSError) and error.errno == errno.EADDRINUSE):
            raise
    host, _port = split_listen(listen)
    log.warning(
        "the %s's remembered address %s is taken by something else; it listens on a new free port "
        "(clients find it through the metaserver)",
        name,
        listen,
    )
    return await stack.enter_async_context(open_server(format_address(host, 0)))


async def _enter_replicas(
    stack: AsyncExitStack,
    open_member: Callable[[Path, str], AbstractAsyncContextManager[Any]],
    master_data: Path,
    count: int,
) -> list[Any]:
    """``count`` more members of a master's group, each on a free port with data in MASTER_DATA-replica-K.

    Opened after the master, so the metaserver makes them its slaves."""
    return [
        await stack.enter_async_context(
            open_member(master_data.with_name(f"{master_data.name}-replica-{k}"), "127.0.0.1:0")
        )
        for k in range(1, count + 1)
    ]


async def _serve(args: argparse.Namespace) -> None:
    data: Path = args.data
    clock = SystemClock()
    await trio.Path(data).mkdir(parents=True, exist_ok=True)
    remembered = read_listen_file(data)
    async with AsyncExitStack() as stack:
        meta = await _enter_listening(
            stack,
            "metaserver",
            args.meta_listen,
            remembered.get("metaserver"),
            lambda listen: open_metaserver(listen=listen, data_dir=data / "metaserver", clock=clock),
        )
        min_insync = min(1, args.replicas)

        def realtime_member(data_dir: Path, listen: str) -> AbstractAsyncContextManager[Any]:
            return open_realtime_server(
                data_dir=data_dir,
                clock=clock,
                listen=listen,
                meta_address=meta.address,
                flush=args.flush,
                min_insync=min_insync,
            )

        def scheduler_member(data_dir: Path, listen: str) -> AbstractAsyncContextManager[Any]:
            return open_scheduler(
                data_dir=data_dir,
                clock=clock,
                listen=listen,
                meta_address=meta.address,
                flush=args.flush,
                min_insync=min_insync,
            )

        realtime = await _enter_listening(
            stack,
            "realtime server",
            args.realtime_listen,
            remembered.get("realtime"),
            partial(realtime_member, data / "realtime-1"),
        )
        realtime_replicas = await _enter_replicas(stack, realtime_member, data / "realtime-1", args.replicas)
        scheduler = await _enter_listening(
            stack,
            "scheduler",
            args.scheduler_listen,
            remembered.get("scheduler"),
            partial(scheduler_member, data / "scheduler-1"),
        )
        replicas = await _enter_replicas(stack, scheduler_member, data / "scheduler-1", args.replicas)
        bound = {"metaserver": meta.address, "realtime": realtime.address, "scheduler": scheduler.address}
        if bound != remembered:
            record = {"format": LISTEN_FORMAT, **bound}
            await run_in_thread(lambda: write_json_atomically(data / LISTEN_FILE, record))
        print(f"metaserver  {meta.address}", flush=True)
        print(f"realtime    {realtime.address}  (group {realtime.group})", flush=True)
        for replica in realtime_replicas:
            print(f"realtime    {replica.address}  (group {replica.group}, a replica)", flush=True)
        print(f"scheduler   {scheduler.address}  (group {scheduler.group})", flush=True)
        for replica in replicas:
            print(f"scheduler   {replica.address}  (group {replica.group}, a replica)", flush=True)
        print(f"data        {await trio.Path(data).resolve()}", flush=True)
        print(f"try: delaymq send --meta {meta.address} demo hello", flush=True)
        print("Ctrl-C stops the cluster.", flush=True)
        await wait_for_stop_signal()
