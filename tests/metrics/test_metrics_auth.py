"""The metrics endpoint of a server with a tokens file answers a bearer token of role admin, metrics or
server only; without a tokens file a server serves it on loopback only.

A refused scrape (401 without a known token, 403 with a token of another role) shows no
metric, and is refused before the server's statistics are read.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from delaymq.cli.metrics import Exposition
from delaymq.cli.metrics_endpoint import open_metrics_endpoint
from delaymq.net.auth import TokenFile

from ..support.tokens import ADMIN, OPS_TOKEN, PRODUCER, SERVER, SHOP_TOKEN, token, tokens_toml
from .test_metrics_mapping import CountingSource

DELAYMQ = [sys.executable, "-P", "-m", "delaymq.cli"]
WAIT = 30.0
SCRAPER = "scraper-secret-0123456789"
TOKENS = tokens_toml(
    OPS_TOKEN,
    token("scheduler-1", SERVER, ["server"], servers=["scheduler:scheduler-1"]),
    SHOP_TOKEN,
    token("prometheus", SCRAPER, ["metrics"]),
)
_METRICS_LINE = re.compile(rb"metrics on http://(?P<address>\S+)/metrics")

Answer = tuple[str, dict[str, str], bytes]


async def get(address: str, *, authorization: str | None = None, path: str = "/metrics") -> Answer:
    """One HTTP request with an optional ``Authorization`` header: status line, headers (lower-case), body."""
    host, _, port = address.rpartition(":")
    head = f"GET {path} HTTP/1.1\r\nHost: {address}\r\n"
    if authorization is not None:
        head += f"Authorization: {authorization}\r\n"
    with trio.fail_after(WAIT):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all((head + "\r\n").encode())
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = raw_head.decode("ascii").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return status, headers, body


def assert_refused(answer: Answer, status: str) -> None:
    """Refused with ``status``, and nothing of the metrics shown."""
    got, headers, body = answer
    assert got == f"HTTP/1.1 {status}"
    assert headers["content-type"].startswith("text/plain") and len(body) < 100
    assert b"delaymq_" not in body and b"process_" not in body
    if status.startswith("401"):
        assert headers["www-authenticate"].startswith("Bearer ")
    else:
        assert "www-authenticate" not in headers


def metric_names(answer: Answer) -> set[str]:
    status, _, body = answer
    assert status == "HTTP/1.1 200 OK"
    return {family.name for family in text_string_to_metric_families(body.decode())}


@pytest.fixture
def tokens(tmp_path: Path) -> TokenFile:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return TokenFile(path)


async def test_only_a_bearer_token_of_role_admin_server_or_metrics_reads_the_metrics(tokens: TokenFile) -> None:
    source = CountingSource()
    async with open_metrics_endpoint(Exposition(source), "127.0.0.2:0", tokens=tokens) as endpoint:
        address = endpoint.address
        assert_refused(await get(address), "401 Unauthorized")
        assert_refused(await get(address, authorization="Bearer not-a-known-secret-at-all"), "401 Unauthorized")
        assert_refused(await get(address, authorization=f"Basic {ADMIN}"), "401 Unauthorized")
        assert_refused(await get(address, authorization=f"Bearer {PRODUCER}"), "403 Forbidden")
        assert_refused(await get(address, path="/elsewhere"), "401 Unauthorized")  # before anything else
        assert source.snapshots == 0  # no refused request had the statistics read
        assert endpoint.refused == 5

        assert "delaymq_test_snapshots" in metric_names(await get(address, authorization=f"Bearer {ADMIN}"))
        assert "delaymq_test_snapshots" in metric_names(await get(address, authorization=f"bearer {SERVER}"))
        assert "delaymq_test_snapshots" in metric_names(await get(address, authorization=f"Bearer {SCRAPER}"))
        assert source.snapshots == 3 and endpoint.scrapes == 3


async def test_a_reloaded_tokens_file_applies_to_the_next_scrape(tokens: TokenFile) -> None:
    async with open_metrics_endpoint(Exposition(CountingSource()), "127.0.0.1:0", tokens=tokens) as endpoint:
        assert metric_names(await get(endpoint.address, authorization=f"Bearer {ADMIN}"))
        tokens.path.write_text(TOKENS.replace(ADMIN, "a-new-admin-secret-0123456789"))
        assert tokens.reload()
        assert_refused(await get(endpoint.address, authorization=f"Bearer {ADMIN}"), "401 Unauthorized")


async def test_a_server_with_a_tokens_file_serves_its_metrics_to_an_admin_token_only(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    argv = ["metaserver", "--listen", "127.0.0.1:0", "--data", str(tmp_path / "meta"), "--tokens-file", str(tokens),
            "--metrics-listen", "127.0.0.1:0"]  # fmt: skip
    process = await trio.lowlevel.open_process([*DELAYMQ, *argv], stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        seen = b""
        with trio.fail_after(WAIT):
            while not (found := _METRICS_LINE.search(seen)):
                chunk = await process.stderr.receive_some(4096)
                assert chunk, f"the metaserver exited with {await process.wait()}: {seen.decode(errors='replace')}"
                seen += chunk
        address = found["address"].decode()
        assert_refused(await get(address), "401 Unauthorized")
        assert_refused(await get(address, authorization="Bearer wrong-secret-0123456789"), "401 Unauthorized")
        assert_refused(await get(address, authorization=f"Bearer {PRODUCER}"), "403 Forbidden")
        assert "delaymq_metaserver_servers" in metric_names(await get(address, authorization=f"Bearer {ADMIN}"))
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(WAIT):
            while chunk := await process.stderr.receive_some(65536):
                seen += chunk
            assert await process.wait() == 0
        assert b"metrics: refused a scrape from 127.0.0.1" in seen  # logged (a line a minute per kind)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("command", ["metaserver", "realtime", "scheduler"])
async def test_without_a_tokens_file_a_metrics_address_off_loopback_stops_the_server_in_one_line(
    tmp_path: Path, command: str
) -> None:
    argv = [command, "--listen", "127.0.0.1:0", "--data", str(tmp_path / "data"), "--metrics-listen", "0.0.0.0:0"]
    with trio.fail_after(WAIT):
        result = await trio.run_process([*DELAYMQ, *argv], capture_stderr=True, capture_stdout=True, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.decode().splitlines()
    assert "--metrics-listen 0.0.0.0:0 is not a loopback address and no --tokens-file is given" in line
    assert "--insecure-listen" in line
    assert result.stdout == b"" and not (tmp_path / "data").exists()
