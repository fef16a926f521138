"""Every rank proves it holds the run secret and the same plan before the run trains (2 gloo processes)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.errors import RankFailureError
from planner.runtime.membership import prove_membership

KEY = b"0123456789abcdef0123456789abcdef"


def _rank(rank: int, store_path: str, out_dir: str, keys: list, digests: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        prove_membership(keys[rank], digests[rank], rank=rank, world_size=2)
        outcome = {"ok": True}
    except RankFailureError as exc:
        outcome = {"error": str(exc)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _prove(tmp_path, keys, digests) -> list[dict]:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), keys, digests), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_with_the_secret_and_the_plan_are_admitted(tmp_path):
    assert _prove(tmp_path, [KEY, KEY], ["a" * 64, "a" * 64]) == [{"ok": True}, {"ok": True}]


@pytest.mark.parametrize("keys, digests", [
    ([KEY, b"an outsider's guess at a secret!"], ["a" * 64, "a" * 64]),   # another secret
    ([KEY, KEY], ["a" * 64, "b" * 64]),                                    # another plan
], ids=["secret", "plan"])
def test_a_rank_without_the_secret_or_with_another_plan_stops_the_run_on_every_rank(tmp_path, keys, digests):
    """Rank 0 (trusted: it holds the first stage) names rank 1; rank 1, judging by its own secret or plan,
    fails too, so nobody trains."""
    first, second = _prove(tmp_path, keys, digests)
    assert first["error"].startswith("ranks [1] did not prove they hold the run secret and this plan")
    assert "did not prove" in second["error"]
