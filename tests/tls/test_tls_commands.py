"""The TLS options on the real commands: a metaserver started from a TOML config with TLS,
asked by ``delaymq status`` with and without the client's TLS options."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from delaymq.cli.connection_options import tls_settings
from delaymq.cli.main import parse_args

if TYPE_CHECKING:
    from ..conftest import Pki

_LISTENING = re.compile(rb"listening on (?P<address>\S+)")
DELAYMQ = [sys.executable, "-P", "-m", "delaymq.cli"]


async def test_a_metaserver_with_tls_from_its_config_serves_tls_clients_and_tells_plaintext_ones(
    tmp_path: Path, pki: Pki
) -> None:
    config = tmp_path / "metaserver.toml"
    config.write_text(
        f'[metaserver]\nlisten = "127.0.0.1:0"\ndata = "{tmp_path / "meta"}"\n'
        f'tls-cert = "{pki.server_cert}"\ntls-key = "{pki.server_key}"\ntls-ca = "{pki.ca}"\n'
        "tls-require-client-cert = true\n"
    )
    process = await trio.lowlevel.open_process(
        [*DELAYMQ, "--config", str(config), "metaserver"], stderr=subprocess.PIPE
    )
    try:
        assert process.stderr is not None
        seen = b""
        with trio.fail_after(30):
            while not _LISTENING.search(seen):
                chunk = await process.stderr.receive_some(4096)
                assert chunk, f"the metaserver exited with {await process.wait()}: {seen.decode(errors='replace')}"
                seen += chunk
        match = _LISTENING.search(seen)
        assert match is not None
        meta = match["address"].decode()
        client = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
        with trio.fail_after(30):
            secured = await trio.run_process([*DELAYMQ, "status", "--meta", meta, *client], capture_stdout=True)
            plaintext = await trio.run_process([*DELAYMQ, "status", "--meta", meta], capture_stderr=True, check=False)
            secured_again = await trio.run_process([*DELAYMQ, "status", "--meta", meta, *client], capture_stdout=True)
            realtime = [*DELAYMQ, "realtime", "--meta", meta, "--listen", "127.0.0.1:0", "--data", str(tmp_path / "rt")]
            plaintext_server = await trio.run_process(realtime, capture_stderr=True, check=False)
        assert b"route version" in secured.stdout and b"route version" in secured_again.stdout  # it answered
        assert plaintext.returncode == 1
        assert b"takes TLS connections only" in plaintext.stderr
        # A plaintext server cannot join a TLS cluster: it says why in one line and exits 1.
        assert plaintext_server.returncode == 1, plaintext_server.stderr
        assert b"cannot run" in plaintext_server.stderr and b"TLS" in plaintext_server.stderr
        assert b"Traceback" not in plaintext_server.stderr
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            while chunk := await process.stderr.receive_some(65536):
                seen += chunk
            assert await process.wait() == 0
        assert seen.count(b"refused a plaintext connection") == 2  # the status, then the realtime server: a line each
        assert b"Traceback" not in seen
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_server_command_names_the_tls_file_it_cannot_read(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "missing.pem"
    argv = ["metaserver", "--data", str(tmp_path / "m"), "--listen", "127.0.0.1:0", "--tls-cert", str(missing)]
    result = await trio.run_process([*DELAYMQ, *argv], capture_stderr=True, check=False)
    assert result.returncode == 2  # a configuration error, as any bad option value
    assert f"--tls-cert {missing}: cannot read it".encode() in result.stderr
    assert b"Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["metaserver", "realtime", "scheduler", "cluster"])
def test_every_server_command_takes_the_tls_options_and_plaintext_is_the_default(command: str, pki: Pki) -> None:
    assert tls_settings(parse_args([command]), server=True) is None
    args = parse_args([command, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)])
    settings = tls_settings(args, server=True)
    assert settings is not None and settings.listens and not settings.require_client_cert
    with pytest.raises(Exception, match="--tls-ca needs --tls-cert"):
        tls_settings(parse_args([command, "--tls-ca", str(pki.ca)]), server=True)


@pytest.mark.parametrize("command", [["send", "s", "b"], ["consume", "s", "--group", "g"], ["status"], ["cancel", "x"]])
def test_client_commands_take_the_tls_options(command: list[str], pki: Pki) -> None:
    args = parse_args([*command, "--tls-ca", str(pki.ca)])
    assert args.tls_ca == pki.ca and args.tls_cert is None
