"""The token options on the real commands: a metaserver child process reloading its tokens file on SIGHUP,
and a server refusing to listen off loopback without one."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from delaymq.cli.connection_options import server_auth
from delaymq.net.auth import FORBIDDEN, UNAUTHORIZED
from delaymq.net.limits import Limits
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError

from .conftest import PRODUCER, TOKENS

_LISTENING = re.compile(rb"listening on (?P<address>\S+)")
DELAYMQ = [sys.executable, "-P", "-m", "delaymq.cli"]
WAIT = 30.0


class Output:
    """The child's stderr, read up to a pattern."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.seen = b""

    async def wait_for(self, pattern: bytes, *, count: int = 1) -> None:
        with trio.fail_after(WAIT):
            while self.seen.count(pattern) < count:
                chunk = await self.stream.receive_some(65536)
                assert chunk, f"the server exited: {self.seen.decode(errors='replace')}"
                self.seen += chunk


async def test_a_metaserver_applies_its_reloaded_tokens_file_to_new_requests_on_sighup(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    argv = ["metaserver", "--listen", "127.0.0.1:0", "--data", str(tmp_path / "meta"), "--tokens-file", str(tokens)]
    process = await trio.lowlevel.open_process([*DELAYMQ, *argv], stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        output = Output(process.stderr)
        await output.wait_for(b"listening on")
        match = _LISTENING.search(output.seen)
        assert match is not None and b"checking every request against 4 token(s)" in output.seen
        meta = match["address"].decode()
        set_state = {"group": "realtime-9", "state": "R"}
        async with open_peers(limits=Limits(token=PRODUCER)) as peers:  # one connection throughout
            with pytest.raises(PeerError) as refused:
                await peers.call(meta, Command.SET_STATE, set_state, timeout=WAIT)
            assert refused.value.code == FORBIDDEN and "role admin needed" in str(refused.value)

            tokens.write_text(TOKENS.replace('roles = ["producer"]', 'roles = ["producer", "admin"]'))
            process.send_signal(signal.SIGHUP)
            await output.wait_for(b"reloaded 4 token(s)")
            with pytest.raises(PeerError) as served:  # past the check: the metaserver knows no such group
                await peers.call(meta, Command.SET_STATE, set_state, timeout=WAIT)
            assert served.value.code == "bad_request" and "unknown group" in str(served.value)

            tokens.write_text("[[token]]\nname = 'half written'\n")  # a bad file: the old table stays
            process.send_signal(signal.SIGHUP)
            await output.wait_for(b"kept the previous tokens")
            assert b"[[token]] #1 (line 1): token: missing" in output.seen
            await peers.call(meta, Command.STATUS, {}, timeout=WAIT)

            tokens.write_text(TOKENS.replace(PRODUCER, "a-new-secret-0123456789"))  # the producer's secret revoked
            process.send_signal(signal.SIGHUP)
            await output.wait_for(b"reloaded 4 token(s)", count=2)
            with pytest.raises(PeerError) as revoked:  # on the connection it authenticated before
                await peers.call(meta, Command.STATUS, {}, timeout=WAIT)
            assert revoked.value.code == UNAUTHORIZED
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(WAIT):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_server_refuses_to_listen_off_loopback_without_a_tokens_file(tmp_path: Path) -> None:
    argv = ["realtime", "--listen", "0.0.0.0:0", "--data", str(tmp_path / "rt")]
    result = await trio.run_process([*DELAYMQ, *argv], capture_stderr=True, check=False)
    assert result.returncode == 2
    assert b"--listen 0.0.0.0:0 is not a loopback address and no --tokens-file is given" in result.stderr
    assert b"--insecure-listen" in result.stderr and b"Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("listen", "insecure", "allowed"),
    [("127.0.0.1:0", False, True), ("[::1]:0", False, True), ("localhost:0", False, True),
     ("0.0.0.0:0", False, False), ("realtime-1:20881", False, False), ("0.0.0.0:0", True, True)],
)  # fmt: skip
def test_only_loopback_is_served_without_a_tokens_file_unless_insecure_listen(
    listen: str, insecure: bool, allowed: bool
) -> None:
    args = argparse.Namespace(tokens_file=None, insecure_listen=insecure, token=None)
    if allowed:
        assert server_auth(args, listen=listen) == (None, None)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="not a loopback address"):
            server_auth(args, listen=listen)


def test_a_server_with_a_bad_tokens_file_does_not_start(tmp_path: Path) -> None:
    bad = tmp_path / "tokens.toml"
    bad.write_text("[[token]]\nname = 'a'\ntoken = 'x-secret-0123456789'\nroles = ['root']\n")
    args = argparse.Namespace(tokens_file=bad, insecure_listen=False, token="t")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(line 1\) \(a\): roles: unknown role 'root'"):
        server_auth(args, listen="0.0.0.0:0")
