"""open_blocking: a data folder opened for a block is released however the block ends."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio

from delaymq.storage.errors import StorageError
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread, run_inline


@pytest.mark.parametrize("run_blocking", [run_in_thread, run_inline], ids=["thread", "inline"])
async def test_a_cancelled_block_still_releases_its_folder(tmp_path: Path, run_blocking: RunBlocking) -> None:
    opener = partial(StateStore.open, tmp_path)
    with trio.CancelScope() as scope:
        async with open_blocking(opener, StateStore.close, run_blocking=run_blocking):
            with pytest.raises(StorageError):
                StateStore.open(tmp_path)  # held: the folder is locked while the block runs
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    StateStore.open(tmp_path).close()  # closed on the way out, cancelled as it was


async def test_an_error_in_the_block_comes_out_after_the_close(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="from the block"):
        async with open_blocking(partial(StateStore.open, tmp_path), StateStore.close, run_blocking=run_inline):
            raise KeyError("from the block")
    StateStore.open(tmp_path).close()
