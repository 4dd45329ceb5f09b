"""Fences on SEND: the scheduler group and epoch a master sends, parsed and refused as the peer's fault."""

from __future__ import annotations

from typing import Any

import pytest

from delaymq.client.routes import RouteTable
from delaymq.net.requests import Request
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import LocalProtocolError, PeerError, RemoteProtocolError
from delaymq.protocol.fencing import EPOCH_MAX, FENCED, Fence, fenced_error
from delaymq.protocol.frames import request


def test_a_fence_travels_as_send_metadata_and_back() -> None:
    fence = Fence("sched-1", 1_700_000_000_123)
    metadata = fence.as_metadata()
    assert metadata == {"fence": {"group": "sched-1", "epoch": 1_700_000_000_123}}
    assert Fence.from_metadata(metadata) == fence


def test_a_send_without_a_fence_has_none() -> None:
    assert Fence.from_metadata({}) is None


@pytest.mark.parametrize(
    ("fence", "field", "words"),
    [
        (7, "fence", "fence is of type int, not a map"),
        ({"group": "sched 1", "epoch": 1}, "fence.group", "may use only A-Z a-z 0-9 . _ -"),
        ({"group": "", "epoch": 1}, "fence.group", "is 0 characters, must be 1 to 128"),
        ({"group": "g" * 129, "epoch": 1}, "fence.group", "is 129 characters, must be 1 to 128"),
        ({"epoch": 1}, "fence.group", "fence.group is of type NoneType, not str"),
        ({"group": "sched-1"}, "fence.epoch", "fence.epoch is of type NoneType"),
        ({"group": "sched-1", "epoch": -1}, "fence.epoch", "fence.epoch is -1, must be an int from 0 to"),
        ({"group": "sched-1", "epoch": True}, "fence.epoch", "fence.epoch is of type bool"),
        ({"group": "sched-1", "epoch": "5"}, "fence.epoch", "fence.epoch is of type str"),
        ({"group": "sched-1", "epoch": 5, "term": 5}, "fence.term", "unknown field 'term' in fence"),
    ],
)
def test_bad_fence_metadata_is_refused_naming_the_field(fence: Any, field: str, words: str) -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        Fence.from_metadata({"fence": fence})
    assert (caught.value.code, caught.value.field) == ("bad_metadata", field)
    assert words in str(caught.value)


def test_building_a_bad_fence_is_our_own_fault() -> None:
    with pytest.raises(LocalProtocolError) as caught:
        Fence("sched-1", EPOCH_MAX + 1)
    assert (caught.value.field, caught.value.limit) == ("fence.epoch", EPOCH_MAX)


def test_the_fenced_refusal_names_group_epochs_and_reaches_the_sender_intact() -> None:
    error = fenced_error(Fence("sched-1", 5), 6)
    assert (error.code, error.field, error.limit) == (FENCED, "fence.epoch", 6)
    assert "'sched-1'" in str(error) and "epoch 5" in str(error) and "epoch 6" in str(error)
    received = PeerError.from_dict(error.to_dict())
    assert (received.code, received.field, received.limit, str(received)) == (FENCED, "fence.epoch", 6, str(error))
    # A deposed master must stop, not try another realtime group.
    assert not RouteTable.is_retryable(received)


def test_a_batch_request_takes_only_the_fields_it_names() -> None:
    fenced = Request(request(Command.SEND, 1, Fence("s", 1).as_metadata(), b"records"), "peer")
    assert fenced.batch_body(fields=("fence",)) == b"records"
    with pytest.raises(RemoteProtocolError) as caught:
        fenced.batch_body()
    assert (caught.value.code, caught.value.field) == ("bad_request", "fence")
    other = Request(request(Command.SEND, 1, {"fence": {}, "x": 1}, b"records"), "peer")
    with pytest.raises(RemoteProtocolError, match=r"SEND takes no metadata but fence") as caught:
        other.batch_body(fields=("fence",))
    assert caught.value.field == "x"
