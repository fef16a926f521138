"""A process's plan rank comes from its host's name in the plan and its local rank, never from the
launcher's global rank (torchrun's c10d orders nodes by name); a wrong name or process count is refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from plan_fixtures import golden_plan

from planner.errors import InvalidInputError
from planner.runtime.launcher.hosts import HOST_ENV, LOCAL_RUN_ENV, Placement, claim, place


def _on_hosts(plan, hosts: dict[int, str]):
    """``plan`` with ranks moved onto the named hosts (rank -> host)."""
    return dataclasses.replace(plan, ranks=tuple(dataclasses.replace(r, host=hosts.get(r.rank, r.host))
                                                 for r in plan.ranks))


def test_the_host_name_and_local_rank_pick_the_plan_rank_whatever_the_launcher_rank():
    plan = _on_hosts(golden_plan(), {1: "box", 2: "box"})   # box runs ranks 1 and 2
    for launcher_rank in (0, 3):                            # c10d's order says nothing
        assert place(plan, host="box", launcher_rank=launcher_rank, local_rank=1,
                     environ={"LOCAL_WORLD_SIZE": "2"}) == Placement(rank=2, host="box", local=False)
    assert place(plan, host=None, launcher_rank=4, local_rank=0,
                 environ={HOST_ENV: "trusted-d", "LOCAL_WORLD_SIZE": "1"}).rank == 3


def test_the_local_launcher_runs_every_rank_here_and_names_no_host():
    assert place(golden_plan(), host=None, launcher_rank=2, local_rank=2,
                 environ={LOCAL_RUN_ENV: "1"}) == Placement(rank=2, host="worker-c", local=True)


def test_a_plan_with_one_host_needs_no_name():
    plan = _on_hosts(golden_plan(), {r: "solo" for r in range(5)})
    assert place(plan, host=None, launcher_rank=0, local_rank=3, environ={"LOCAL_WORLD_SIZE": "5"}).rank == 3


@pytest.mark.parametrize("host, nproc, message", [
    (None, "1", "expected --host NAME or STAGEWISE_HOST=NAME, NAME one of the plan's hosts (trusted-a, box, trusted-d, verifier)"),
    ("intruder", "1", "host 'intruder'; expected one of the plan's hosts"),
    ("box", "1", "host 'box' runs ranks [1, 2] of the plan; expected 2 processes on it"),
], ids=["no-name", "unknown", "nproc"])
def test_a_missing_or_wrong_host_name_or_process_count_is_refused(host, nproc, message):
    plan = _on_hosts(golden_plan(), {1: "box", 2: "box"})
    with pytest.raises(InvalidInputError) as info:
        place(plan, host=host, launcher_rank=0, local_rank=0, environ={"LOCAL_WORLD_SIZE": nproc})
    assert message in str(info.value)


def test_a_plan_rank_claimed_twice_is_refused_naming_its_host():
    store = dist.HashStore()
    mine = Placement(rank=0, host="trusted-a", local=False)
    claim(store, mine)
    claim(store, Placement(rank=1, host="worker-b", local=False))
    with pytest.raises(InvalidInputError, match="rank 0 of the plan \\(host 'trusted-a'\\) is taken"):
        claim(store, mine)                                   # a second host started as trusted-a
