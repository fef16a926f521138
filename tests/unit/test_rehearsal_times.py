"""The rehearsal's local prices timed as its ranks run them (``planner.profiling.rehearsal_times``): the plan's
own stages in the rehearsal's dtype, its verifiers' checks, and the prediction built on them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.errors import InvalidInputError
from planner.profiling.rehearsal_times import rehearsal_times
from planner.rehearsal import LocalTimes, predict_rehearsal, timeable
from tests.dist.plans import make_plan
from tests.unit.test_rehearsal import GOLDEN, PROFILE


@pytest.fixture(scope="module")
def plan():
    # 3 stages, two checked boundaries (activations of 0 on a verifier host, gradients of 1)
    return make_plan("gpt-tiny", microbatch=2, num_microbatches=2, stages=[(0, 1), (2, 3), (4, 5)], seq=16,
                     verifiers=[(0, 3, ("act",)), (1, 3, ("grad",))], verifier_host=True)


@pytest.fixture(scope="module")
def timed(plan):
    return rehearsal_times(plan, "bfloat16", repeats=2, gap_s=0.0)


def test_every_stage_and_every_check_is_timed(plan, timed):
    assert len(timed.fwd_ms) == len(timed.bwd_ms) == plan.num_stages
    assert all(ms > 0 for ms in (*timed.fwd_ms, *timed.bwd_ms))
    assert {(b, d) for b, d, _ in timed.check_ms} == {(0, "F"), (1, "B")}
    assert all(ms > 0 for _, _, ms in timed.check_ms) and timed.blame_ms > 0
    assert len(timed.optim_ms) == plan.num_stages and all(ms > 0 for ms in timed.optim_ms)
    # two microbatches a rank: the second runs warm, right after the first, and is timed so too
    assert len(timed.fwd_warm_ms) == len(timed.bwd_warm_ms) == plan.num_stages
    assert all(ms > 0 for ms in (*timed.fwd_warm_ms, *timed.bwd_warm_ms))


def test_the_prediction_prices_what_was_timed(plan, timed):
    here = predict_rehearsal(plan, PROFILE, emulate=True, local=timed)
    assert here.timed
    costs = here.costs
    for r, info in enumerate(plan.ranks):
        if info.stage is not None:
            m = len(info.microbatches)   # the first pass cold, the rest warm
            assert costs.local_ms(r, "F") == pytest.approx((timed.fwd_ms[info.stage]
                                                            + (m - 1) * timed.fwd_warm_ms[info.stage]) / m)
            assert costs.local_ms(r, "B") == pytest.approx((timed.bwd_ms[info.stage]
                                                            + (m - 1) * timed.bwd_warm_ms[info.stage]) / m)
            assert costs.optim_ms(r) == pytest.approx(timed.optim_ms[info.stage])
    for b, d, ms in timed.check_ms:
        assert costs.verify_ms(3, b, d) == pytest.approx(ms)
    slower = dataclasses.replace(timed, bwd_ms=tuple(10 * ms for ms in timed.bwd_ms))
    assert predict_rehearsal(plan, PROFILE, emulate=True, local=slower).result.step_ms > here.result.step_ms
    dearer = dataclasses.replace(timed, optim_ms=tuple(ms + 5.0 for ms in timed.optim_ms))
    assert predict_rehearsal(plan, PROFILE, emulate=True, local=dearer).result.step_ms > here.result.step_ms


def test_times_for_another_plan_are_refused(plan, timed):
    short = LocalTimes(fwd_ms=timed.fwd_ms[:2], bwd_ms=timed.bwd_ms[:2])
    with pytest.raises(InvalidInputError, match="timed stages"):
        predict_rehearsal(plan, PROFILE, emulate=True, local=short)


def test_a_model_from_a_factory_is_not_timed():
    from planner.plan_load import load_plan

    golden = load_plan(GOLDEN)
    assert not timeable(golden) and rehearsal_times(golden, "float32") is None
    # priced by the profile's blocks alone: nothing here was timed, and the report says so
    here = predict_rehearsal(golden, PROFILE, emulate=True)
    assert not here.timed and here.to_json()["timed_here"] is None


def test_a_report_of_the_times_reprices_the_same_step(plan, timed):
    here = predict_rehearsal(plan, PROFILE, emulate=True, slowdown=2.0, local=timed)
    doc = json.loads(json.dumps(here.to_json()))
    assert doc["timed"] and doc["step_ms"] == here.result.step_ms and doc["profile"] == here.device
    again = LocalTimes.from_json(doc["timed_here"])
    assert again == timed
    assert predict_rehearsal(plan, PROFILE, emulate=True, slowdown=2.0, local=again).result == here.result
