"""What ends a step besides the programs (``planner.simulate``): the verdict exchange of a verified step, the
global norm of a clipped one, and the passes an accumulating run makes per optimizer step."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.verify import verdict_exchange
from planner.errors import InvalidInputError
from planner.instructions import SEND_OPS, VERDICT_OPS, VERIFY_OPS
from planner.simulate import simulate, without_verification
from tests.dist.plans import make_plan


def test_the_verdict_exchange_waits_for_flags_sketches_and_counts():
    ready = {0: 10.0, 1: 8.0, 2: 5.0}
    heard = verdict_exchange(ready, verifiers=[0, 2], counters=[0], message_ms=lambda a, b: 1.0, blame_ms=0.5)
    # flags: both verifiers ready at 10, two all-gathers of one ring step each; blame; the lead tells the rest
    assert heard == {0: 12.5, 1: 13.5, 2: 13.5}
    late = verdict_exchange({**ready, 1: 20.0}, verifiers=[0, 2], counters=[0], sketches=[1],
                            message_ms=lambda a, b: 1.0, blame_ms=0.5)
    assert late[0] == 20.0 + 1.0 + 2.0 + 0.5  # the replica's sketch reaches the lead first
    counted = verdict_exchange(ready, verifiers=[2], counters=[0, 1], message_ms=lambda a, b: 1.0, blame_ms=0.5)
    assert counted[2] == 11.0 and counted[0] == 12.0  # the first stage's count (ready at 10) decides


@pytest.fixture(scope="module")
def plan():
    return make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)],
                     verifiers=[(0, 2, ("act", "grad"))], verifier_host=True)


def test_a_verified_step_ends_when_the_first_stage_hears_the_verdict(plan):
    verified = simulate(plan, verdicts=True)
    control = [e for e in verified.events if e.kind == "control"]
    assert control and {e.rank for e in control} <= set(range(plan.num_ranks))
    first = set(plan.stage_ranks(0))
    assert verified.step_ms == pytest.approx(max(e.end_ms for e in control if e.rank in first))
    off = dataclasses.replace(plan, policy=dataclasses.replace(plan.policy, enabled=False))
    unverified = simulate(off, verdicts=True)
    assert not [e for e in unverified.events if e.kind == "control"]
    assert verified.step_ms > unverified.step_ms and verified.step_ms > simulate(plan).step_ms


def test_clipping_holds_every_optimizer_step_until_the_global_norm(plan):
    plain, clipped = simulate(plan), simulate(plan, clip=True)
    assert clipped.step_ms >= plain.step_ms  # the control rank (the first stage's) often arrives last anyway
    optims = {e.rank: e for e in clipped.events if e.kind == "optim"}
    arrived = max(e.start_ms for e in plain.events if e.kind == "optim")
    assert all(e.start_ms >= arrived for e in optims.values())
    assert [e for e in clipped.events if e.kind == "control" and e.label == "gradient norm"]


def test_accumulated_passes_add_whole_passes_without_the_optimizer_step(plan):
    one, two, three = (simulate(plan, accumulate=k).step_ms for k in (1, 2, 3))
    assert two > one and three - two == pytest.approx(two - one)
    assert two - one < one  # a pass without the all-reduce, the optimizer step and the verdicts
    with pytest.raises(InvalidInputError, match="accumulated passes"):
        simulate(plan, accumulate=0)


def test_a_run_predicts_the_step_it_takes(plan):
    from planner.runtime.options import RunOptions
    from planner.runtime.outputs.run_report import predicted_step_ms

    assert predicted_step_ms(plan, RunOptions(plan="p.json")) == plan.predicted.step_ms
    clipped = RunOptions(plan="p.json", clip_grad=1.0, accumulate=2)
    assert predicted_step_ms(plan, clipped) == pytest.approx(simulate(plan, clip=True, accumulate=2).step_ms)


def test_a_run_without_verification_sends_no_copies_and_checks_nothing(plan):
    bare = without_verification(plan)
    assert not bare.verifiers and not bare.policy.enabled
    ops = [(r, i) for r, prog in enumerate(bare.programs) for i in prog]
    assert not [i for _, i in ops if i.op in VERIFY_OPS or i.op in VERDICT_OPS]
    for r, i in ops:
        if i.op in SEND_OPS:  # only to the rank that computes on it next
            step = plan.ranks[r].stage + (1 if i.direction == "F" else -1)
            assert i.peer == plan.owner(step, i.mb)
    assert simulate(bare).step_ms < simulate(plan).step_ms
    from planner.runtime.options import RunOptions
    from planner.runtime.outputs.run_report import predicted_step_ms

    assert predicted_step_ms(plan, RunOptions(plan="p.json", verify=False)) == pytest.approx(simulate(bare).step_ms)
