"""A member's identity: the stable id of its data folder, and its epoch history.

The id is made at a member's first start and kept in the file ``member`` beside the
data (not in lmdb), so a copied data folder is made a member of its own by deleting
that one file (docs/replication.md). The metaserver knows a member by it across
restarts on other ports.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from delaymq.replication.epochs import EpochHistory
from delaymq.storage.folder import fsync_directory
from delaymq.storage.state import StateStore

#: The file in the data folder holding the member's stable id (sent to the metaserver).
MEMBER_FILE = "member"


def member_identity(root: Path, state: StateStore) -> tuple[EpochHistory, str]:
    """The member's epoch history and its stable id, made now if it has none (blocking)."""
    path = root / MEMBER_FILE
    try:
        member = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        member = ""
    if not member:
        member = secrets.token_hex(8)
        temporary = path.with_name(MEMBER_FILE + ".new")
        with open(temporary, "w", encoding="ascii") as file:
            file.write(member + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        fsync_directory(root)
    return EpochHistory.load(state), member


__all__ = ["MEMBER_FILE", "member_identity"]
