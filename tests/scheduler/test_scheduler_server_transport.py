"""A peer killed mid-connection (its socket reset) must not stop a server.

Found while killing a scheduler with SIGKILL: the realtime server it was sending to
stopped, because ``FrameServer`` let the ``BrokenResourceError`` of a reset
connection escape (wrapped in an exception group) into its listener's nursery.
"""

from __future__ import annotations

import socket
import struct

import trio

from delaymq.net.peers import open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.protocol.commands import Command


async def test_a_connection_reset_by_a_killed_peer_leaves_the_server_serving() -> None:
    async def ping(request: Request) -> dict[str, int]:
        return {"pong": 1}

    server = FrameServer({Command.PING: ping})
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1", 0)
            host, port = address.rsplit(":", 1)
            for number, partial in enumerate((b"", b"DQ\x01"), start=1):  # idle; in the middle of a frame
                sock = socket.create_connection((host, int(port)))
                sock.sendall(partial)
                # A killed process's socket: closed with an RST, not a FIN.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
                while (stats := server.statistics()).connections_total < number or stats.connections_open:
                    await trio.sleep(0.01)  # until the server has taken the connection and dropped it
            async with open_peers() as peers:
                answer = await peers.call(address, Command.PING, {})
            assert answer.metadata == {"pong": 1}
            nursery.cancel_scope.cancel()
