"""The hill-climb's neighbours keep their verifiers true to their boundaries (``search.polish._live``).

Merging a stage onto its neighbour's devices, or dropping a replica, used to keep a split verifier's named
senders: a verifier naming devices its boundary no longer had checked nothing, passed ``violations`` at a
boundary that needed no check, and failed the pricing (``stagewise plan gpt-medium --dtype fp32 --time-limit
60`` on the default cluster: KeyError 'verifier/0'). Now such a verifier is cut to the senders left or
dropped, and ``violations`` names any placement that still carries one."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.cluster import DEFAULT_CLUSTER_PATH
from cost_models.cluster_file import load_cluster
from cost_models.training import TrainingConfig
from planner.model_io import load_chain
from planner.solver import api as solver_api
from planner.solver.objective import Placement, boundary_senders, even_split, price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.search.polish import _merged, _neighbours
from planner.solver.shared_verifiers import split_boundary
from planner.solver.solution import StagePlacement, VerifierPlacement
from tests.unit.program_fixtures import replicated_untrusted_placement

M = 4
VOLUNTEERS = ("volunteer-1/0", "volunteer-2/0")


@pytest.fixture(scope="module")
def problem():
    _, chain = load_chain("gpt-tiny", batch=1, seq=32)
    config = TrainingConfig(global_batch=M, microbatch_size=1, dtype="float32")
    return solver_api.problem_for(chain, load_cluster(DEFAULT_CLUSTER_PATH), config, VerificationPolicy(), 1)[0]


def _stage(index: int, first: int, last: int, devices: tuple[str, ...]) -> StagePlacement:
    return StagePlacement(index=index, first_block=first, last_block=last, devices=devices,
                          microbatches=even_split(M, len(devices)))


def _placement(problem) -> Placement:
    """A100 | two volunteers (their gradients split over two verifiers) | L4 | A100: a valid plan."""
    L = problem.num_blocks
    stages = (_stage(0, 0, 1, ("dc-a100/0",)), _stage(1, 2, 3, VOLUNTEERS), _stage(2, 4, L - 2, ("lab-l4/0",)),
              _stage(3, L - 1, L - 1, ("dc-a100/1",)))
    verifiers = (VerifierPlacement(boundary=0, device="verifier/0", directions=("grad",), senders=VOLUNTEERS[:1]),
                 VerifierPlacement(boundary=0, device="dc-a100/0", directions=("grad",), senders=VOLUNTEERS[1:]),
                 VerifierPlacement(boundary=1, device="verifier/0", directions=("act",)))
    return Placement(stages=stages, verifiers=verifiers, num_microbatches=M)


def _stale(v: VerifierPlacement, placement: Placement) -> bool:
    return bool(set(v.senders) - set(boundary_senders(placement.stages, v.boundary, v.directions)))


def test_the_plan_is_valid_and_priced(problem):
    placement = _placement(problem)
    assert violations(problem, placement) == ()
    assert price_program(problem, placement).step_ms > 0


def test_every_neighbour_names_only_senders_its_boundaries_have_and_the_valid_ones_price(problem):
    placement = _placement(problem)
    valid = 0
    for cand in _neighbours(problem, placement, cuts_only=False):
        assert not any(_stale(v, cand) for v in cand.verifiers), cand.verifiers
        if not violations(problem, cand):
            valid += 1
            assert price_program(problem, cand).step_ms > 0
    # the volunteers' stage merged onto the L4: boundary 0 (A100 -> L4) needs no check, its verifiers dropped
    onto_l4 = [c for c in _neighbours(problem, placement, cuts_only=False)
               if [(st.first_block, st.devices) for st in c.stages] == [(0, ("dc-a100/0",)), (2, ("lab-l4/0",)),
                                                                        (problem.num_blocks - 1, ("dc-a100/1",))]]
    assert onto_l4 and onto_l4[0].verifiers == () and not violations(problem, onto_l4[0]) and valid >= 2


def test_violations_names_a_verifier_of_senders_its_boundary_no_longer_has(problem):
    placement = _placement(problem)
    merged = [c for c in _merged(placement, 1) if c.stages[1].devices == ("lab-l4/0",)][0]
    stale = dataclasses.replace(merged, verifiers=placement.verifiers[:2])  # as _merged made it before
    assert any("names a sender the boundary no longer has" in v for v in violations(problem, stale))


def test_random_untrusted_plans_with_split_verifiers_climb_to_neighbours_true_to_their_boundaries():
    """Random SENTINEL-like pools in small, every boundary's senders split over its verifier sites where it has
    several: no neighbour of the climb names a sender its boundary lacks, and each valid one prices."""
    split = 0
    for seed in range(40):
        drawn = replicated_untrusted_placement(seed, max_stages=5)
        if drawn is None:
            continue
        problem, placement = drawn[:2]
        for b in sorted({v.boundary for v in placement.verifiers}):
            placement = split_boundary(problem, placement, b) or placement
        split += len({v.boundary for v in placement.verifiers}) < len(placement.verifiers)
        for cand in _neighbours(problem, placement, cuts_only=False):
            assert not any(_stale(v, cand) for v in cand.verifiers), (seed, cand.verifiers)
            if not violations(problem, cand):
                assert price_program(problem, cand).step_ms > 0
    assert split >= 10, split
