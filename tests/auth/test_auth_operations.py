"""What an operator sees of the tokens on the real commands: SIGHUP (``systemctl reload``) on a
server without a tokens file is logged and ignored, and a tokens file the server cannot use stops
it at start with one line and exit status 2."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command

from .test_auth_commands import Output

_LISTENING = re.compile(rb"listening on (?P<address>\S+)")
DELAYMQ = [sys.executable, "-P", "-m", "delaymq.cli"]
WAIT = 30.0


async def test_sighup_without_a_tokens_file_is_logged_and_the_server_keeps_serving(tmp_path: Path) -> None:
    argv = ["metaserver", "--listen", "127.0.0.1:0", "--data", str(tmp_path / "meta")]
    process = await trio.lowlevel.open_process([*DELAYMQ, *argv], stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        output = Output(process.stderr)
        await output.wait_for(b"listening on")
        match = _LISTENING.search(output.seen)
        assert match is not None
        for count in (1, 2):
            process.send_signal(signal.SIGHUP)
            await output.wait_for(b"SIGHUP: no --tokens-file to reload; ignored", count=count)
            async with open_peers() as peers:
                answer = await peers.call(match["address"].decode(), Command.PING, {}, timeout=WAIT)
            assert "now_ms" in answer.metadata
        assert process.returncode is None
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(WAIT):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[[token]]\nname = 'shop'\ntoken = 'too-short'\nroles = ['producer']\n",
         "token: 9 characters, fewer than the 16"),
        ("# every token removed\n", "holds no [[token]]"),
    ],
    ids=["short secret", "no token"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["scheduler", "cluster"])
async def test_a_tokens_file_the_server_cannot_use_stops_it_at_start_in_one_line(
    tmp_path: Path, command: str, text: str, problem: str
) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(text)
    data = tmp_path / "data"
    argv = [command, "--data", str(data), "--tokens-file", str(tokens)]
    with trio.fail_after(WAIT):
        result = await trio.run_process([*DELAYMQ, *argv], capture_stderr=True, capture_stdout=True, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.decode().splitlines()
    assert f"--tokens-file {tokens}: " in line and problem in line
    assert result.stdout == b"" and not data.exists()
