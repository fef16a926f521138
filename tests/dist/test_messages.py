"""Control messages between ranks travel as JSON in tensors: what a peer sends is parsed and checked,
never unpickled; a malformed one is an error naming its sender (2 gloo processes)."""
from __future__ import annotations

import os
import pickle

import pytest

from planner.errors import RankFailureError
from planner.runtime.wire import messages
from tests.dist.two_ranks import two_ranks

SCHEMA = {"type": "object", "required": ["rank", "loss"], "additionalProperties": False,
          "properties": {"rank": {"type": "integer"}, "loss": {"type": "number"}}}


class Exploit:
    """What a hostile rank would send through pickle: unpickling it would run a command."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/stagewise-pwned",))


def _gather(rank: int, payloads: list) -> list:
    return messages.all_gather_json(payloads[rank], group=None, ranks=[0, 1], what="test summary", schema=SCHEMA,
                                    doing="testing")


def test_well_formed_messages_arrive_on_every_rank(tmp_path):
    sent = [{"rank": 0, "loss": 1.5}, {"rank": 1, "loss": float("nan")}]
    for outcome in two_ranks(tmp_path, _gather, sent):
        got = outcome["ok"]
        assert got[0] == sent[0] and got[1]["rank"] == 1 and got[1]["loss"] != got[1]["loss"]  # NaN kept


@pytest.mark.parametrize("bad", [
    {"rank": 1, "loss": "1.0; import os"},                       # wrong type
    {"rank": 1, "loss": 1.0, "code": "__import__('os')"},        # a key the schema does not know
    pickle.dumps(Exploit()).hex(),                                # a pickle, as text: it stays text
])
def test_a_malformed_message_is_an_error_naming_its_sender_on_every_rank(tmp_path, bad):
    for outcome in two_ranks(tmp_path, _gather, [{"rank": 0, "loss": 1.0}, bad]):
        assert outcome["error"].startswith("rank 1 sent a malformed test summary")
    assert not os.path.exists("/tmp/stagewise-pwned")


def test_decode_refuses_bytes_that_are_not_json():
    with pytest.raises(RankFailureError, match="rank 3 sent a malformed flags.*UTF-8 JSON"):
        messages.decode(pickle.dumps(Exploit()), sender=3, what="flags", schema={})
    assert not os.path.exists("/tmp/stagewise-pwned")
