"""``delaymq cluster``: the all-in-one local cluster on loopback, one process per server.

A metaserver, a realtime server and a scheduler, each with its own folder under
``--data``; the embedded default a new user starts with (``make run``).
``--replicas N`` gives the realtime group and the scheduler group N slaves each
(``DATA/realtime-1-replica-K``, ``DATA/scheduler-1-replica-K``) with sync
replication: a write waits for every in-sync slave, and a group keeps serving
through the death of any one member.

Each server runs as its own child process, the ``delaymq metaserver|realtime|scheduler``
command a production deployment runs, supervised (``delaymq.cli.supervisor``): one
Ctrl-C or SIGTERM stops them all, a child that exits unexpectedly is reported and
started again on the same data and address, and none outlives the cluster process,
even SIGKILLed.

Each server keeps its address across restarts, so a restart is a pause and not a
move: clients' cached routes and the metaserver's registry stay right. An
address given with a port is used as given; one with port 0, or none (the
realtime server and the scheduler by default), is a free port chosen on the
first start. Either way the addresses bound are remembered in
``DATA/cluster-listen.json`` (``{"format": 1, "metaserver": "127.0.0.1:20880",
"realtime": "127.0.0.1:41735", "scheduler": "127.0.0.1:41737"}``) and used
again at the next start; a remembered port that something else has taken since
gives way to a new free one, with a warning.

The cluster's TLS options, ``--tokens-file`` and ``--insecure-listen`` are passed on
to each server's command line; its token (``--token``, or ``DELAYMQ_TOKEN``) goes in
each server's environment as ``DELAYMQ_TOKEN``, never on a command line (``ps`` shows
those to every user). With a tokens file, that token needs role server with
``servers = ["realtime:realtime-1", "scheduler:scheduler-1"]``.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import trio

from delaymq.cli import options
from delaymq.cli.connection_options import TOKEN_ENV, add_tls_options, load_tokens_file, tls_settings, token
from delaymq.cli.scheduler_command import LOAD_AHEAD, SEND_AHEAD, SEND_INTERVAL
from delaymq.cli.serving import STARTUP_ERRORS, fail
from delaymq.cli.supervisor import StartFailed, Supervisor, open_supervisor
from delaymq.client.producer import DEFAULT_META
from delaymq.net.addresses import format_address, split_listen
from delaymq.storage.format import write_json_atomically
from delaymq.storage.threads import run_in_thread

log = logging.getLogger("delaymq.cluster")

#: Where the cluster remembers the addresses its servers bound (in ``--data``).
LISTEN_FILE = "cluster-listen.json"
LISTEN_FORMAT = 1
SERVERS = ("metaserver", "realtime", "scheduler")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="run a local all-in-one cluster (metaserver, realtime, scheduler), a process each",
        description=(
            "Run a metaserver, a realtime server and a scheduler on loopback, each as its own supervised "
            "process with its folder under --data (one restarted if it exits; Ctrl-C stops them all). "
            "Producers and consumers use --meta-listen. "
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
    options.add_duration(
        parser,
        "--send-interval",
        SEND_INTERVAL,
        "the scheduler's --send-interval: a subject's SENDs to realtime at least this far apart",
    )
    options.add_duration(
        parser,
        "--send-ahead",
        SEND_AHEAD,
        "the scheduler's --send-ahead: each message goes to realtime this long before its deliver_at "
        "(held there until then)",
    )
    options.add_duration(
        parser,
        "--load-ahead",
        LOAD_AHEAD,
        "the scheduler's --load-ahead: each second's messages are read from disk this long before they fall due",
    )
    parser.add_argument(
        "--replicas",
        type=_replicas,
        default=0,
        metavar="N",
        help="slaves to run beside the realtime master and beside the scheduler master (data in "
        "DATA/realtime-1-replica-K and DATA/scheduler-1-replica-K); with one or more, replication is sync (a write "
        "waits for every in-sync slave) and the metaserver fails over to a slave within about a second "
        "(default: %(default)s)",
    )
    add_tls_options(parser, server=True)  # passed on to every server; the certificate must name 127.0.0.1
    parser.set_defaults(func=run)


def _replicas(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: --replicas takes a whole number from 0 to 8")
    return int(text)


def run(args: argparse.Namespace) -> int:
    """Run the cluster until a stop signal; a server that cannot start ends it with one line, status 1."""
    try:
        tls_settings(args, server=True)  # a missing or unreadable file: one line now, not one per server
        if getattr(args, "tokens_file", None) is not None:
            load_tokens_file(Path(args.tokens_file))  # so is a tokens file that holds no valid tokens
    except argparse.ArgumentTypeError as error:
        return fail(str(error))
    try:
        return trio.run(_serve, args)
    except BaseException as raised:  # noqa: B036 - sorted below: start-up errors are one line, the rest re-raised
        errors = _leaves(raised)
        if any(isinstance(error, KeyboardInterrupt) for error in errors):
            raise KeyboardInterrupt from None  # Ctrl-C before the signal handler was in place
        if not all(isinstance(error, (StartFailed, *STARTUP_ERRORS)) for error in errors):
            raise
        return fail(f"cannot run the local cluster with data {args.data}: {'; '.join(map(str, errors))}", code=1)


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups: servers started together may fail together."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


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


def port_is_free(listen: str) -> bool:
    """Whether ``listen`` can be bound now (as a server binds it: with SO_REUSEADDR)."""
    host, port = split_listen(listen)
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            return True
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return False
        raise


def _listen_for(name: str, asked: str | None, remembered: str | None) -> str:
    """Where a server is started first: ``choose_listen``, but a remembered port taken since gives way."""
    listen, is_remembered = choose_listen(asked, remembered)
    if is_remembered and not port_is_free(listen):
        host, _port = split_listen(listen)
        log.warning(
            "the %s's remembered address %s is taken by something else; it listens on a new free port "
            "(clients find it through the metaserver)",
            name,
            listen,
        )
        return format_address(host, 0)
    return listen


def tls_options(args: argparse.Namespace) -> list[str]:
    """The cluster's ``--tls-*`` options, ``--tokens-file`` and ``--insecure-listen``, for each server's command
    line. Not its token: that goes in each server's environment (``server_environment``), which ``ps`` does
    not show."""
    given = [(f"--tls-{name}", getattr(args, f"tls_{name}")) for name in ("cert", "key", "ca")]
    given += [("--tokens-file", getattr(args, "tokens_file", None))]
    passed = [text for option, value in given if value is not None for text in (option, str(value))]
    flags = [("--tls-require-client-cert", args.tls_require_client_cert), ("--insecure-listen", args.insecure_listen)]
    return passed + [flag for flag, given_flag in flags if given_flag]


def server_environment(args: argparse.Namespace) -> dict[str, str]:
    """What each server's environment gets on top of the cluster's: the cluster's token (``--token`` or
    ``$DELAYMQ_TOKEN``) as ``DELAYMQ_TOKEN``, never on a command line."""
    own = token(args)
    return {TOKEN_ENV: own} if own is not None else {}


def server_command(log_level: str, command: str, *options: str) -> list[str]:
    """The command line of one server: ``delaymq COMMAND ...``, as run in production."""
    return [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", log_level, command, *options]


async def _serve(args: argparse.Namespace) -> int:
    data: Path = args.data
    await trio.Path(data).mkdir(parents=True, exist_ok=True)
    remembered = read_listen_file(data)
    level = getattr(logging, args.log_level.upper())
    # A child announces its address at info, so it logs at least that; the supervisor passes on what ``level`` shows.
    child_level = "debug" if level <= logging.DEBUG else "info"
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_supervisor(log_level=level) as supervisor:
            with trio.CancelScope() as serving:
                supervisor.stop_on(signals, serving)
                await _start_servers(args, supervisor, remembered, child_level)
                await trio.sleep_forever()
    return 130 if supervisor.stopped_by == signal.SIGINT else 0


async def _start_servers(
    args: argparse.Namespace, supervisor: Supervisor, remembered: dict[str, str], child_level: str
) -> None:
    """The metaserver and both masters (the metaserver first on a first start); their slaves; the report.

    A server announces its address after its first registration, so the masters
    register with the metaserver up (and are masters at once), and each master is
    registered before its slaves, which the metaserver then makes slaves. The two
    masters start together: each takes about half a second to import, and a
    scheduler up first retries a delivery within ~0.1 s.
    """
    data: Path = args.data
    meta_listen = _listen_for("metaserver", args.meta_listen, remembered.get("metaserver"))
    meta = meta_listen
    tls = tls_options(args)
    env = server_environment(args)

    async def start_metaserver() -> None:
        nonlocal meta
        meta = await supervisor.start(
            "metaserver",
            lambda listen: server_command(
                child_level, "metaserver", "--listen", listen, "--data", str(data / "metaserver"), *tls
            ),
            listen=meta_listen,
            env=env,
        )

    dispatch_options = (
        *("--send-interval", f"{options.duration_ms(args.send_interval)}ms"),
        *("--send-ahead", f"{options.duration_ms(args.send_ahead)}ms"),
        *("--load-ahead", f"{options.duration_ms(args.load_ahead)}ms"),
    )

    def member(kind: str, folder: str) -> Callable[[str], list[str]]:
        given = ("--meta", meta, "--data", str(data / folder), "--group", f"{kind}-1", "--flush", args.flush, *tls)
        if kind == "scheduler":
            given += dispatch_options
        return lambda listen: server_command(child_level, kind, "--listen", listen, *given)

    masters: dict[str, str] = {}

    async def start_master(kind: str, name: str, asked: str | None) -> None:
        listen = _listen_for(name, asked, remembered.get(kind))
        masters[kind] = await supervisor.start(f"{kind}-1", member(kind, f"{kind}-1"), listen=listen, stage=1, env=env)

    replicas: dict[str, list[str]] = {"realtime": [""] * args.replicas, "scheduler": [""] * args.replicas}

    async def start_replica(kind: str, k: int) -> None:
        folder = f"{kind}-1-replica-{k}"
        replicas[kind][k - 1] = await supervisor.start(
            folder, member(kind, folder), listen="127.0.0.1:0", stage=2, env=env
        )

    # On a restart the metaserver's address is known before it binds: the masters
    # start beside it (each import takes about half a second) and register once it
    # is up, retrying from 100 ms. On a first start they need the port it chose.
    known = split_listen(meta_listen)[1] != 0
    if not known:
        await start_metaserver()
    async with trio.open_nursery() as nursery:
        if known:
            nursery.start_soon(start_metaserver)
        nursery.start_soon(start_master, "realtime", "realtime server", args.realtime_listen)
        nursery.start_soon(start_master, "scheduler", "scheduler", args.scheduler_listen)
    async with trio.open_nursery() as nursery:
        for kind in replicas:
            for k in range(1, args.replicas + 1):
                nursery.start_soon(start_replica, kind, k)
    bound = {"metaserver": meta, **masters}
    if bound != remembered:
        record = {"format": LISTEN_FORMAT, **bound}
        await run_in_thread(lambda: write_json_atomically(data / LISTEN_FILE, record))
    print(f"metaserver  {meta}", flush=True)
    print(f"realtime    {masters['realtime']}  (group realtime-1)", flush=True)
    for address in replicas["realtime"]:
        print(f"realtime    {address}  (group realtime-1, a replica)", flush=True)
    print(f"scheduler   {masters['scheduler']}  (group scheduler-1)", flush=True)
    for address in replicas["scheduler"]:
        print(f"scheduler   {address}  (group scheduler-1, a replica)", flush=True)
    print(f"data        {await trio.Path(data).resolve()}", flush=True)
    print(f"try: delaymq send --meta {meta} demo hello", flush=True)
    print("Ctrl-C stops the cluster.", flush=True)
