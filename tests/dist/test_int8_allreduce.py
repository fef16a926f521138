"""A replicated stage's gradient all-reduce under blockwise int8 with error feedback (``allreduce_codec: int8``;
gloo on CPU, one process per rank): the replicas apply the same sum, bit for bit, the run stays near the exact
one, and over steps the accumulated error stays bounded (error feedback) where it would not without it.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from cost_models.codecs import int8_allreduce_bytes
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.runtime.rank import replica_checks
from planner.runtime.wire.grad_codecs import Int8ReduceState
from tests.dist.plans import load_dumps, make_plan, reference_run
from tests.dist.two_ranks import two_ranks

torch.set_num_threads(1)

STEPS = 5
# Relative drift of each step's loss from the exact run (as tests/dist/test_powersgd_allreduce.py): int8's
# error is far below PowerSGD's, the same bound still catches a sum that lost its scale or its residual.
LOSS_RTOL = 5e-3
N = 3000
WIRE_STEPS = 20


def _with_int8(plan, stage: int):
    stages = tuple(dataclasses.replace(st, allreduce_codec="int8") if st.index == stage else st
                   for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def _accumulate(rank: int, feedback: bool) -> dict:
    """``WIRE_STEPS`` int8 sums over both ranks through the runtime's all-gather, a trained count riding
    last; the exact fp32 all-reduce of the same gradients alongside as the reference."""
    gen = torch.Generator().manual_seed(10 + rank)
    steady = torch.where(torch.arange(N) % 128 == 0, 50.0, 0.1) * torch.rand(N, generator=gen)
    state, received = Int8ReduceState(N), []
    applied, true, gaps, sums = torch.zeros(N), torch.zeros(N), [], []

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        parts = replica_checks._gather(t, group=None, ranks=[0, 1], doing="test")
        received.append(sum(p.numel() * p.element_size() for i, p in enumerate(parts) if i != rank))
        return parts

    for _ in range(WIRE_STEPS):
        if not feedback:
            state.error = None
        grad = steady + 0.02 * torch.randn(N, generator=gen)
        exact = grad.clone()
        dist.all_reduce(exact)
        flat = torch.cat([grad, torch.tensor([3.0 + rank])])
        state.reduce(flat, gather, [0, 1])
        assert float(flat[-1]) == 7.0   # the trained counts sum exactly
        applied += flat[:-1]
        true += exact
        gaps.append(float((applied - true).norm() / true.norm()))
        sums.append(float(flat[:-1].double().sum()))
    return {"gaps": gaps, "sums": sums, "received": received}


def test_int8_sums_over_gloo_are_identical_bounded_and_priced(tmp_path):
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    on, off = two_ranks(tmp_path / "on", _accumulate, True), two_ranks(tmp_path / "off", _accumulate, False)
    for result in (on, off):
        assert all("ok" in r for r in result), result
        assert result[0]["ok"]["sums"] == result[1]["ok"]["sums"]   # both replicas apply the same sums
    # 4 bytes more than priced a step: the verified run's trained count, sent raw
    assert on[0]["ok"]["received"] == [int8_allreduce_bytes(N, 2) + 4] * WIRE_STEPS
    with_ef, without = on[0]["ok"]["gaps"], off[0]["ok"]["gaps"]
    # first step: half a quantisation step of each block's absmax at most, about 1% of this sum's norm
    assert with_ef[0] == without[0] < 0.05
    assert with_ef[-1] < 0.2 * with_ef[0]        # the error left out does not grow with the steps
    assert without[-1] > 0.5 * without[0]        # without error feedback the same small values drop each step
    assert with_ef[-1] < 0.2 * without[-1]
    print(f"relative error of the sum over {WIRE_STEPS} steps: {with_ef[-1]:.2e} with error feedback, "
          f"{without[-1]:.2e} without (step 1: {with_ef[0]:.2e})")


def _check_run(plan, stage: int, tmp_path) -> None:
    """Run ``plan``: its losses near the exact run's, yet not equal (compressed), and ``stage``'s replicas'
    weights equal bit for bit (every replica decodes the same bytes and sums them in rank order)."""
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp_path / "dump")))
    exact, _, _ = reference_run(plan, steps=STEPS)
    got, want = torch.tensor(result["losses"]), torch.tensor(exact)
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0.0)
    assert not torch.equal(got[1:], want[1:])
    dumps = [d for d in load_dumps(tmp_path / "dump", plan.num_ranks) if d["stage"] == stage]
    assert len(dumps) == 2
    for name, p in dumps[0]["params"].items():
        torch.testing.assert_close(dumps[1]["params"][name], p, rtol=0.0, atol=0.0, msg=lambda m, n=name: f"{n}: {m}")


def test_int8_replicas_agree_and_train_close_to_the_exact_run(tmp_path):
    plan = _with_int8(make_plan("gpt-tiny", microbatch=2, num_microbatches=4, seq=16, stages=[(0, 2), (3, 5)],
                                replicas={0: (2, 2)}, schedule="1f1b", optimizer="adam"), 0)
    assert [st.allreduce_codec for st in plan.stages] == ["int8", "none"]
    _check_run(plan, 0, tmp_path)


def test_a_verified_run_s_trained_counts_travel_beside_the_int8_payload(tmp_path):
    """Verification appends each replica's trained count to its flat gradient; it travels raw beside the int8
    payload (summed exactly: tests/unit/test_int8_allreduce.py), and the verified run trains as the exact one."""
    plan = _with_int8(make_plan("mlp-tiny", microbatch=2, num_microbatches=4, stages=[(0, 1), (2, 3), (4, 5)],
                                replicas={1: (2, 2)}, untrusted=(1, 2), verifier_host=True, optimizer="adam",
                                verifiers=[(0, 4, ("act", "grad")), (1, 4, ("act", "grad"))]), 1)
    assert plan.policy.enabled and plan.stage_ranks(1) == (1, 2)
    _check_run(plan, 1, tmp_path)
