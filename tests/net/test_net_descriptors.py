"""Out of file descriptors (EMFILE), a server answers new clients with a refusal and recovers.

Before: trio's ``serve_listeners`` met EMFILE with a logged traceback every 100 ms
while queued clients waited unanswered. The server runs in a child process with
a low open-file limit, so the test process keeps its own descriptors.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import trio

from delaymq.net.connection import PeerUnavailable
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command

HOG, FREE = 900, 901

SERVER = """
import logging, os, resource, sys, trio
from delaymq.protocol.commands import Command
from delaymq.net.limits import ConnectionLimits, Limits
from delaymq.net.server import FrameServer

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
hogged = []

async def ping(request):
    return {"pid": os.getpid()}

async def hog(request):
    # Take every free descriptor, as a server with too many files open would.
    while True:
        try:
            hogged.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return {"hogged": len(hogged)}

async def free(request):
    while hogged:
        os.close(hogged.pop())
    return {}

async def main():
    limits = Limits(connections=ConnectionLimits(spare_fds=1))
    server = FrameServer({Command.PING: ping, 900: hog, 901: free}, limits=limits)
    async with trio.open_nursery() as nursery:
        print(await nursery.start(server.serve), flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_out_of_descriptors_new_clients_are_refused_promptly_and_served_again_after(
    tmp_path: Path, server_processes: SimpleNamespace
) -> None:
    stderr_path = tmp_path / "server.log"
    async with server_processes.python(SERVER, "64", log_file=stderr_path) as (address, _process):
        with trio.fail_after(60):
            async with open_peers() as keeper:
                await keeper.call(address, Command.PING)
                hogged = (await keeper.call(address, HOG)).metadata["hogged"]
                assert hogged > 0
                refusals = []
                for _ in range(20):
                    async with open_peers() as newcomer:
                        try:
                            await newcomer.call(address, Command.PING, timeout=5)
                        except PeerUnavailable as error:
                            refusals.append(str(error))
                assert len(refusals) == 20
                assert all("out of file descriptors (accept: EMFILE)" in message for message in refusals), refusals[0]
                await keeper.call(address, Command.PING)  # an established client is still served
                await keeper.call(address, FREE)
            async with open_peers() as newcomer:
                await newcomer.call(address, Command.PING, timeout=5)
    log = stderr_path.read_text()
    assert "Traceback" not in log
    assert log.count("refusing connections") == 1, log  # one line for the episode, not one per client
