"""Control messages between ranks travel as JSON in tensors: what a peer sends is parsed and checked,
never unpickled; a malformed one is an error naming its sender (2 gloo processes)."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.errors import RankFailureError
from planner.runtime import messages

SCHEMA = {"type": "object", "required": ["rank", "loss"], "additionalProperties": False,
          "properties": {"rank": {"type": "integer"}, "loss": {"type": "number"}}}


class Exploit:
    """What a hostile rank would send through pickle: unpickling it would run a command."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/stagewise-pwned",))


def _rank(rank: int, store_path: str, out_dir: str, payloads: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        got = messages.all_gather_json(payloads[rank], group=None, ranks=[0, 1], what="test summary",
                                       schema=SCHEMA, doing="testing")
        outcome = {"ok": got}
    except RankFailureError as exc:
        outcome = {"error": str(exc)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _exchange(tmp_path, payloads) -> list[dict]:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), payloads), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_well_formed_messages_arrive_on_every_rank(tmp_path):
    sent = [{"rank": 0, "loss": 1.5}, {"rank": 1, "loss": float("nan")}]
    for outcome in _exchange(tmp_path, sent):
        got = outcome["ok"]
        assert got[0] == sent[0] and got[1]["rank"] == 1 and got[1]["loss"] != got[1]["loss"]  # NaN kept


@pytest.mark.parametrize("bad", [
    {"rank": 1, "loss": "1.0; import os"},                       # wrong type
    {"rank": 1, "loss": 1.0, "code": "__import__('os')"},        # a key the schema does not know
    pickle.dumps(Exploit()).hex(),                                # a pickle, as text: it stays text
])
def test_a_malformed_message_is_an_error_naming_its_sender_on_every_rank(tmp_path, bad):
    for outcome in _exchange(tmp_path, [{"rank": 0, "loss": 1.0}, bad]):
        assert outcome["error"].startswith("rank 1 sent a malformed test summary")
    assert not os.path.exists("/tmp/stagewise-pwned")


def test_decode_refuses_bytes_that_are_not_json():
    with pytest.raises(RankFailureError, match="rank 3 sent a malformed flags.*UTF-8 JSON"):
        messages.decode(pickle.dumps(Exploit()), sender=3, what="flags", schema={})
    assert not os.path.exists("/tmp/stagewise-pwned")
