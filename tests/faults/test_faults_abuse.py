"""A hostile client holding valid tokens, against a live ``delaymq cluster`` with a tokens file.

Each probe is what a holder of a producer, consumer or other group's server token tried
against the servers; each must be refused with its reason, and what it aimed at must be
unchanged: routes, fences, group states, the server's memory and descriptors, and
another tenant's messages (both tenants' messages with one id are delivered). The
refusals are printed in the fault suite's figures.
"""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.client import open_consumer, open_producer
from delaymq.net.addresses import parse_address
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.frames import FRAME_HEADER, MAGIC, VERSION, FrameDecoder, FrameKind
from delaymq.protocol.records import Message, encode_batch, new_message_id

from ..support.tokens import token, tokens_toml

pytestmark = pytest.mark.faults

CLUSTER = "cluster-secret-0123456789"
ROGUE = "rogue-server-secret-0123456789"
SHOP = "shop-secret-0123456789"
PAYMENTS = "payments-secret-0123456789"
ORDERS_READER = "orders-reader-secret-0123456789"
OPS = "ops-secret-0123456789"
TOKENS = tokens_toml(
    token("cluster", CLUSTER, ["server"], servers=["realtime:realtime-1", "scheduler:scheduler-1"]),
    token("rogue-server", ROGUE, ["server"], servers=["realtime:realtime-2"]),
    token("shop", SHOP, ["producer"], subjects=["orders.*"]),
    token("payments", PAYMENTS, ["producer"], subjects=["payments.*"]),
    token("orders-reader", ORDERS_READER, ["consumer"], subjects=["orders.*", "payments.*"], groups=["orders-*"]),
    token("ops", OPS, ["admin"]),
)
WAIT = 60.0
MiB = 1024 * 1024


def child_pids(parent: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(entry.name))
    return pids


def process_of(parent: int, kind: str) -> int:
    for pid in child_pids(parent):
        if f" {kind} ".encode() in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") + b" ":
            return pid
    raise AssertionError(f"no {kind} child of {parent}")


def rss(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def refusal(address: str, token: str, command: int, metadata: dict[str, Any], body: bytes = b"") -> str:
    """The request's refusal as ``code: message``; it must be ``forbidden``."""
    async with open_peers(limits=Limits(token=token)) as peers:
        with pytest.raises(PeerError) as refused:
            await peers.call(address, command, metadata, body, timeout=WAIT)
    assert refused.value.code == "forbidden", refused.value
    return f"{refused.value.code}: {refused.value}"


async def ask(address: str, token: str, command: int, metadata: dict[str, Any]) -> dict[str, Any]:
    async with open_peers(limits=Limits(token=token)) as peers:
        return (await peers.call(address, command, metadata, timeout=WAIT)).metadata


async def start_cluster(root: Path, log: Any) -> tuple[trio.Process, dict[str, str]]:
    tokens = root / "tokens.toml"
    tokens.write_text(TOKENS)
    command = [sys.executable, "-P", "-m", "delaymq.cli", "--log-level", "info", "cluster", "--data",
               str(root / "data"), "--tokens-file", str(tokens)]  # fmt: skip
    env = {**os.environ, "DELAYMQ_TOKEN": CLUSTER}
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=log, env=env)
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(WAIT):
        while b"Ctrl-C" not in buffer:
            chunk = await process.stdout.receive_some(4096)
            assert chunk, "the cluster exited before it was ready"
            buffer += chunk
    addresses = dict(re.findall(r"^(metaserver|realtime|scheduler)\s+(\S+)", buffer.decode(), re.M))
    return process, addresses


def row(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(r for r in status["rows"] if r["kind"] == kind)


async def probe_servers(addresses: dict[str, str], report: dict[str, str]) -> None:
    """A producer's fence, another group's server token, a consumer's foreign group."""
    meta, realtime = addresses["metaserver"], addresses["realtime"]
    before = await ask(meta, OPS, Command.STATUS, {})
    fence = {"fence": {"group": "scheduler-1", "epoch": 2**63 - 1}}
    batch = encode_batch([Message(new_message_id(), "orders.eu", body=b"x")])
    report["fence_by_producer"] = await refusal(realtime, SHOP, Command.SEND, fence, batch)
    rogue = {"group": "realtime-1", "kind": "realtime", "role": "master", "address": "127.0.0.1:9",
             "version": "x", "incarnation": "rogue", "member": row(before, "realtime")["member"] or "m"}  # fmt: skip
    report["register_other_group"] = await refusal(meta, ROGUE, Command.REGISTER, rogue)
    heartbeat = {"group": "realtime-1", "address": realtime}
    report["heartbeat_other_group"] = await refusal(meta, ROGUE, Command.HEARTBEAT, heartbeat)
    fetch = {"group": "realtime-1", "address": "127.0.0.1:9", "epoch": 0, "offset": 0, "last_epoch": 0}
    report["fetch_other_group"] = await refusal(realtime, ROGUE, Command.FETCH, fetch)
    nrw = {"group": "realtime-1", "state": "NRW"}
    report["set_state_by_server"] = await refusal(meta, CLUSTER, Command.SET_STATE, nrw)
    pull = {"group": "billing", "consumer": "intruder", "subject": "orders.eu", "max": 10}
    report["pull_as_other_group"] = await refusal(realtime, ORDERS_READER, Command.PULL, pull)
    ack = {"group": "billing", "consumer": "intruder", "subject": "orders.eu", "start": 0, "end": 10}
    report["ack_as_other_group"] = await refusal(realtime, ORDERS_READER, Command.ACK, ack)
    after = await ask(meta, OPS, Command.STATUS, {})
    for kind in ("realtime", "scheduler"):
        assert (row(after, kind)["address"], row(after, kind)["state"]) == (
            row(before, kind)["address"],
            row(before, kind)["state"],
        )


async def probe_memory(addresses: dict[str, str], cluster: int, report: dict[str, str]) -> None:
    """2 MiB of empty msgpack arrays, before AUTH and after it: the metaserver's memory stays."""
    meta = process_of(cluster, "metaserver")
    host, port = parse_address(addresses["metaserver"])
    count = 2 * MiB
    metadata = b"\x81\xa1x\xdd" + struct.pack(">I", count) + b"\x90" * count
    frame = FRAME_HEADER.pack(MAGIC, VERSION, FrameKind.REQUEST, Command.STATUS, 7, len(metadata), 0) + metadata
    before = rss(meta)
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(frame[:65536])
    decoder = FrameDecoder()
    with trio.fail_after(WAIT):
        while (answer := decoder.next_frame()) is None:
            decoder.feed(await stream.receive_some(65536))
    await stream.aclose()
    report["status_2mib_before_auth"] = f"{answer.metadata['error']['code']}: {answer.metadata['error']['message']}"
    grown = rss(meta) - before
    report["metaserver_rss_growth_mib"] = f"{grown / MiB:.1f}"
    assert answer.metadata["error"]["code"] == "unauthorized" and grown < 16 * MiB


async def probe_subjects(addresses: dict[str, str], cluster: int, report: dict[str, str]) -> None:
    """One SEND of 3,000 new subjects: the realtime server does not keep 3,000 descriptors."""
    realtime = process_of(cluster, "realtime")
    before = open_fds(realtime)
    batch = encode_batch([Message(new_message_id(), f"orders.flood-{n}", body=b"x") for n in range(3000)])
    async with open_peers(limits=Limits(token=SHOP)) as peers:
        await peers.call(addresses["realtime"], Command.SEND, {}, batch, timeout=WAIT)
    grown = open_fds(realtime) - before
    report["fds_after_3000_subjects"] = str(grown)
    assert grown < 300


async def probe_tenants(addresses: dict[str, str], report: dict[str, str]) -> None:
    """Tenant payments sends ids first; shop's messages with the same ids are stored and delivered."""
    meta = addresses["metaserver"]
    ids = [new_message_id() for _ in range(2)]
    async with open_producer(meta, limits=Limits(token=PAYMENTS)) as payments:
        await payments.send_batch([payments.message("payments.eu", b"theirs", id=ids[0])])
        await payments.send_batch([payments.message("payments.eu", b"theirs", id=ids[1], delay=0.5)])
    async with open_producer(meta, limits=Limits(token=SHOP)) as shop:
        await shop.send_batch([shop.message("orders.eu", b"ours", id=ids[0])])
        await shop.send_batch([shop.message("orders.eu", b"ours", id=ids[1], delay=0.5)])
    received = set()
    async with open_consumer(
        meta, "orders.eu", group="orders-tenants", start="earliest", limits=Limits(token=ORDERS_READER)
    ) as consumer:
        with trio.fail_after(WAIT):
            while not set(ids) <= received:
                message = await consumer.receive()
                await consumer.ack(message)
                if message.body == b"ours":
                    received.add(str(message.id))
    report["same_id_other_tenant"] = "both stored, both delivered"


async def test_a_token_holder_is_refused_and_changes_nothing(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any
) -> None:
    report: dict[str, str] = {}
    with (tmp_path / "cluster.log").open("wb") as log, servers_must_not_crash(tmp_path):
        process, addresses = await start_cluster(tmp_path, log)
        try:
            await probe_servers(addresses, report)
            await probe_memory(addresses, process.pid, report)
            await probe_subjects(addresses, process.pid, report)
            await probe_tenants(addresses, report)
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(WAIT):
                await process.wait()
    for probe, answer in report.items():
        print(f"{probe}: {answer}")
    # The figures table takes the code of each refusal (the whole line is printed above).
    fault_report.record(**{probe: answer.split(": ")[0].replace(" ", "_") for probe, answer in report.items()})
