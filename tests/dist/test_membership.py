"""Every rank proves it holds the run secret and the same plan before the run trains (2 gloo processes)."""
from __future__ import annotations

import pytest

from planner.runtime.launcher.membership import prove_membership
from tests.dist.two_ranks import two_ranks

KEY = b"0123456789abcdef0123456789abcdef"


def _prove(rank: int, keys: list, digests: list) -> bool:
    prove_membership(keys[rank], digests[rank], rank=rank, world_size=2)
    return True


def test_ranks_with_the_secret_and_the_plan_are_admitted(tmp_path):
    assert two_ranks(tmp_path, _prove, [KEY, KEY], ["a" * 64, "a" * 64]) == [{"ok": True}, {"ok": True}]


@pytest.mark.parametrize("keys, digests", [
    ([KEY, b"an outsider's guess at a secret!"], ["a" * 64, "a" * 64]),   # another secret
    ([KEY, KEY], ["a" * 64, "b" * 64]),                                    # another plan
], ids=["secret", "plan"])
def test_a_rank_without_the_secret_or_with_another_plan_stops_the_run_on_every_rank(tmp_path, keys, digests):
    """Rank 0 (trusted: it holds the first stage) names rank 1; rank 1, judging by its own secret or plan,
    fails too, so nobody trains."""
    first, second = two_ranks(tmp_path, _prove, keys, digests)
    assert first["error"].startswith("ranks [1] did not prove they hold the run secret and this plan")
    assert "did not prove" in second["error"]
