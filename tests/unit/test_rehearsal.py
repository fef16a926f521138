"""The rehearsal cost model (``CostModel.for_rehearsal``, ``planner.rehearsal``): a plan for remote devices priced
as ``stagewise run`` runs it on the machine a profile describes."""
from __future__ import annotations

from pathlib import Path

import pytest

from cost_models.compute import range_bwd_ms, range_fwd_ms
from cost_models.devices import load_profile_spec
from planner.errors import InvalidInputError
from planner.plan import load_plan
from planner.rehearsal import predict_rehearsal
from planner.runtime.emulate import emulation_for
from planner.simulate import CostModel, simulate

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
    assert got.result.step_ms == pytest.approx(simulate(plan, costs, cores=2, emulated=True,
                                                        messages=_messages()).step_ms)
    assert got.result.step_ms > predict_rehearsal(plan, PROFILE, emulate=False, cores=2).result.step_ms
    assert got.result.step_ms != pytest.approx(simulate(plan).step_ms)


def _messages():
    from cost_models.measured import load_message_cost
    return load_message_cost(PROFILE)


def test_a_profile_without_p2p_is_refused(plan, tmp_path):
    import json
    doc = json.loads(PROFILE.read_text())
    doc["device"].pop("p2p_bandwidth_gbps")
    doc["device"].pop("p2p_latency_ms")
    bare = tmp_path / "no_p2p.json"
    bare.write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match="point-to-point link measured"):
        predict_rehearsal(plan, bare, emulate=True)
