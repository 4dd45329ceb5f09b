"""The metrics endpoint of a server with a TLS certificate speaks HTTPS, with that certificate."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from delaymq.cli.metrics import Exposition
from delaymq.cli.metrics_endpoint import open_metrics_endpoint

if TYPE_CHECKING:
    from ..conftest import Pki

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class _Source:
    """One counter, so a scrape's answer can be recognised."""

    async def snapshot(self) -> int:
        return 7

    def families(self, snapshot: int) -> Iterable[Metric]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("delaymq_test_scrapes", "A fixed count")
        family.add_metric([], snapshot)
        return [family]


async def _read_all(stream: trio.abc.Stream) -> bytes:
    data = b""
    with trio.fail_after(10):
        try:
            while chunk := await stream.receive_some(65536):
                data += chunk
        except trio.BrokenResourceError:  # a TLS peer that closes without close_notify
            pass
    return data


async def test_the_metrics_of_a_tls_server_are_served_over_https_only(pki: Pki) -> None:
    async with open_metrics_endpoint(Exposition(_Source()), "127.0.0.1:0", tls=pki.server()) as endpoint:
        assert endpoint.scheme == "https"
        host, port = endpoint.address.split(":")
        tcp = await trio.open_tcp_stream(host, int(port))
        secured = trio.SSLStream(tcp, pki.client().client_context(), server_hostname=host)
        async with secured:
            await secured.send_all(REQUEST)
            answer = await _read_all(secured)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        families = {family.name: family for family in text_string_to_metric_families(body.decode())}
        assert families["delaymq_test_scrapes"].samples[0].value == 7

        plain = await trio.open_tcp_stream(host, int(port))
        async with plain:
            await plain.send_all(REQUEST)
            assert not (await _read_all(plain)).startswith(b"HTTP/")  # no plaintext answer
        assert endpoint.scrapes == 1


async def test_without_tls_the_endpoint_stays_plain_http() -> None:
    async with open_metrics_endpoint(Exposition(_Source()), "127.0.0.1:0") as endpoint:
        assert endpoint.scheme == "http"
        host, port = endpoint.address.split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(REQUEST)
            assert (await _read_all(stream)).startswith(b"HTTP/1.1 200 OK")
