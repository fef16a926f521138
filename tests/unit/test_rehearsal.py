"""The rehearsal cost model (``CostModel.for_rehearsal``, ``planner.rehearsal``): a plan for remote devices priced
as ``stagewise run`` runs it on the machine a profile describes."""
from __future__ import annotations

from pathlib import Path

import pytest

from cost_models.comm import transfer_ms
from cost_models.compute import range_bwd_ms, range_fwd_ms
from cost_models.devices import load_profile_spec
from cost_models.measured import load_message_cost
from cost_models.verify import verify_ms
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel
from planner.plan_load import load_plan
from planner.rehearsal import predict_rehearsal, profile_warnings
from planner.runtime.rank.emulate import emulation_for
from planner.simulate import simulate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "golden_plan.json"      # 5 ranks: stage 1 replicated on a fast and a 2x slower device
PROFILE = FIXTURES / "profile_cpu.json"     # `stagewise profile --quick` of this machine kind


@pytest.fixture(scope="module")
def plan():
    return load_plan(GOLDEN)


@pytest.mark.parametrize("slowdown", [1.0, 3.0])
def test_passes_are_padded_by_the_runtimes_own_factors(plan, slowdown):
    local = load_profile_spec(PROFILE)
    costs = CostModel.for_rehearsal(plan, local, emulate=True, slowdown=slowdown)
    chain, dtype = plan.chain(), plan.config.dtype
    for rank, info in enumerate(plan.ranks):
        if info.stage is None:
            continue
        stage = plan.stages[info.stage]
        here_f = range_fwd_ms(chain, stage.first_block, stage.last_block, local, dtype)
        here_b = range_bwd_ms(chain, stage.first_block, stage.last_block, local, dtype)
        pad = emulation_for(plan, rank, slowdown=slowdown)
        assert costs.local_ms(rank, "F") == pytest.approx(here_f) and costs.local_ms(rank, "B") == pytest.approx(here_b)
        assert costs.compute_ms(rank, "F") == pytest.approx(pad.fwd_factor * here_f)
        assert costs.compute_ms(rank, "B") == pytest.approx(pad.bwd_factor * here_b)
    assert costs.compute_ms(2, "F") == pytest.approx(2.0 * slowdown * costs.local_ms(2, "F")), "the slow replica"


def test_every_rank_talks_over_the_profiled_local_link(plan):
    local = load_profile_spec(PROFILE)
    costs = CostModel.for_rehearsal(plan, local, emulate=True)
    planned = CostModel.for_plan(plan)
    for src, dst in ((0, 1), (0, 2), (2, 3), (0, 4)):
        link = costs._link(src, dst)
        assert (link.bandwidth_gbps, link.latency_ms) == (local.p2p_bandwidth_gbps, local.p2p_latency_ms)
    assert costs.transfer_ms(0, 2, 0, "F") != planned.transfer_ms(0, 2, 0, "F")


def test_without_emulated_speeds_every_rank_computes_at_this_machines_speed(plan):
    costs = CostModel.for_rehearsal(plan, load_profile_spec(PROFILE), emulate=False)
    assert costs.compute_ms(1, "F") == pytest.approx(costs.compute_ms(2, "F")), "the slow replica is not padded"
    with pytest.raises(InvalidInputError, match="emulated speeds"):
        CostModel.for_rehearsal(plan, load_profile_spec(PROFILE), emulate=False, slowdown=2.0)


def test_prediction_shares_this_machines_cores_and_differs_from_the_planned_devices(plan):
    got = predict_rehearsal(plan, PROFILE, emulate=True, cores=2)
    costs = CostModel.for_rehearsal(plan, load_profile_spec(PROFILE), emulate=True)
    assert got.cores == 2 and got.device == load_profile_spec(PROFILE).name and got.measured_messages
    assert got.result.step_ms == pytest.approx(simulate(plan, costs, cores=2, emulated=True, verdicts=True,
                                                        messages=load_message_cost(PROFILE)).step_ms)
    # padding holds no core: the emulated run is priced differently from the plain one
    assert got.result.step_ms != pytest.approx(predict_rehearsal(plan, PROFILE, emulate=False, cores=2).result.step_ms,
                                               rel=1e-6)
    assert got.result.step_ms != pytest.approx(simulate(plan).step_ms)


def test_a_profile_without_p2p_is_refused(plan, tmp_path):
    import json
    doc = json.loads(PROFILE.read_text())
    doc["device"].pop("p2p_bandwidth_gbps")
    doc["device"].pop("p2p_latency_ms")
    bare = tmp_path / "no_p2p.json"
    bare.write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match="point-to-point link measured"):
        predict_rehearsal(plan, bare, emulate=True)


def test_a_plan_for_this_machine_is_priced_as_it_was_planned():
    """Planned on the profiled device itself: the stage ranks' compute and optimizer are the plan's own;
    the links change to the profile's measured one, and the verifier host (a catalog CPU in the plan)
    checks at the profiled device's speed."""
    from tests.dist.plans import make_plan

    local = load_profile_spec(PROFILE)
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=4, stages=[(0, 2), (3, 5)], seq=16,
                     device_types=[str(PROFILE)] * 2, verifiers=[(0, 2, ("act", "grad"))], verifier_host=True)
    planned, here = CostModel.for_plan(plan), CostModel.for_rehearsal(plan, local, emulate=True)
    for rank in range(plan.num_ranks):
        for op in ("F", "B"):
            assert here.compute_ms(rank, op) == pytest.approx(planned.compute_ms(rank, op))
        assert here.optim_ms(rank) == pytest.approx(planned.optim_ms(rank))
    assert plan.ranks[2].device_type == "CPU" and here.spec[2] == local
    assert here.verify_ms(2, 0, "F") == pytest.approx(verify_ms(here.boundary_bytes[0], local))
    assert here.transfer_ms(0, 1, 0, "F") == pytest.approx(transfer_ms(here.boundary_bytes[0], _profile_link(local)))
    assert here.transfer_ms(0, 1, 0, "F") != pytest.approx(planned.transfer_ms(0, 1, 0, "F"))


def _profile_link(spec):
    from cost_models.cluster import Link
    return Link(bandwidth_gbps=spec.p2p_bandwidth_gbps, latency_ms=spec.p2p_latency_ms)


def test_profile_warnings_name_a_poor_fit_and_a_busy_machine():
    quiet = {"calibration": {"median_abs_rel_err": 0.1}, "host": {"busy_fraction_before": 0.1}}
    assert profile_warnings(quiet, busy_now=0.2) == ()
    poor = {"calibration": {"median_abs_rel_err": 0.83}, "host": {"busy_fraction_before": 0.9}}
    got = profile_warnings(poor, busy_now=0.6)
    assert len(got) == 3
    assert "83% off" in got[0] and "90% busy with other work when profiled" in got[1] and "60% busy" in got[2]
    assert profile_warnings({}) == ()  # an older profile without the figures
