"""Listen and peer addresses: ``host:port`` parsed and formatted one way everywhere."""

from __future__ import annotations


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 in brackets) as (host, port), with a clear error."""
    return _host_port(address, "address", lowest_port=1)


def split_listen(listen: str) -> tuple[str, int]:
    """A listen address ``"host:port"`` as (host, port); port 0 asks for any free port."""
    return _host_port(listen, "listen address", lowest_port=0)


def _host_port(text: str, what: str, *, lowest_port: int) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not lowest_port <= int(port_text) <= 65535:
        raise ValueError(f"{what} {text!r} is not HOST:PORT with a port from {lowest_port} to 65535")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ------------------------------------------------------------------- serving
