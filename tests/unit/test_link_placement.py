"""Verifier placement that keeps the link and residual tests: one verifier for the boundaries on both
sides of each untrusted stage, trusted inputs copied to it watch-only, priced against the cheapest
placement within the policy's share, and the tests a plan loses said."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.check import trust_problems
from planner.errors import InvalidInputError
from planner.plan_values import VerifierInfo
from planner.solver.link_tests import keep_link_tests, lost_link_tests
from planner.solver.objective import price_program
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.baselines import baseline_placement
from planner.solver.verifiers import assign_verifiers, link_windows
from tests.unit.solver_fixtures import random_chain

CLUSTER = parse_cluster({"name": "four", "hosts": [
    {"name": f"h{i}", "region": "lab", "trust": "op" if i in (0, 3) else f"vol{i}", "trusted": i in (0, 3),
     "devices": [{"type": "T4", "count": 1}]} for i in range(4)],
    "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})


def problem(**policy):
    chain = random_chain(np.random.default_rng(1), 8, param_scale=2e7, flop_scale=5e10, out_scale=2e7)
    cfg = TrainingConfig(global_batch=8, microbatch_size=1, dtype="float16", optimizer="adam")
    return build_problem(scale_chain(chain, 1), CLUSTER, cfg, VerificationPolicy(**policy))


def test_the_boundaries_around_untrusted_stages_form_one_window() -> None:
    p = problem()
    placement = baseline_placement("uniform", p)
    assert [st.devices for st in placement.stages] == [("h0/0",), ("h1/0",), ("h2/0",), ("h3/0",)]
    assert link_windows(p, placement.stages) == [(0, 1, 2)]


def test_a_linked_window_sits_on_one_verifier_with_the_trusted_inputs_watched() -> None:
    p = problem()
    stages = baseline_placement("uniform", p).stages
    linked = assign_verifiers(p, stages, p.num_microbatches, link=3)
    assert linked is not None and len({v.device for v in linked}) == 1
    by_b = {v.boundary: v for v in linked}
    assert by_b[0].directions == ("act", "grad") and by_b[0].watch_only == ("act",)   # stage 1's input
    assert by_b[1].directions == ("act", "grad") and by_b[1].watch_only == ()
    assert by_b[2].directions == ("act", "grad") and by_b[2].watch_only == ("grad",)  # stage 2's input gradient
    pieces = assign_verifiers(p, stages, p.num_microbatches, link=2)   # (0, 1) and (2,): stage 1 linked only
    assert pieces is not None and pieces[0].device == pieces[1].device
    assert lost_link_tests(p, dataclasses.replace(baseline_placement("uniform", p), verifiers=linked)) == ()


def test_the_linked_placement_is_kept_within_the_policy_share_and_the_loss_said_beyond() -> None:
    cheap = baseline_placement("uniform", problem())
    linked = dataclasses.replace(cheap, verifiers=assign_verifiers(problem(), cheap.stages, cheap.num_microbatches,
                                                                   link=3))
    ratio = price_program(problem(), linked).step_ms / price_program(problem(), cheap).step_ms
    assert lost_link_tests(problem(), cheap)       # the per-boundary greedy splits the window here
    generous = problem(link_test_cost=ratio)       # the whole window's price is within the share: kept
    assert lost_link_tests(generous, keep_link_tests(generous, cheap)) == ()
    assert ratio > 1.05                            # one verifier for all six copies costs here (simulated: 1.067)
    p = problem(link_test_cost=0.0)                # nothing more is worth paying: the cheapest stays, its loss said
    assert keep_link_tests(p, cheap) == cheap
    lost = lost_link_tests(p, cheap)
    assert lost and all("no link or residual test" in line for line in lost)


def test_a_watch_only_copy_checks_nothing() -> None:
    """A plan that marked an untrusted sender's tensor watch-only would let it through unflagged."""
    stages = (("h0/0",), ("h1/0",), ("h3/0",))
    ok = [SimpleNamespace(boundary=0, device="h0/0", directions=("act", "grad"), watch_only=("act",)),
          SimpleNamespace(boundary=1, device="h3/0", directions=("act",), watch_only=())]
    assert trust_problems(stages, ok, CLUSTER, VerificationPolicy()) == []
    evading = [ok[0], SimpleNamespace(boundary=1, device="h3/0", directions=("act",), watch_only=("act",))]
    assert trust_problems(stages, evading, CLUSTER, VerificationPolicy()) == \
        ["boundary 1 (act) has an untrusted sender and no verifier"]


def test_watch_only_must_be_among_the_directions() -> None:
    with pytest.raises(InvalidInputError, match="watch_only"):
        VerifierInfo(boundary=0, rank=0, device="h0/0", directions=("grad",), watch_only=("act",))
    with pytest.raises(InvalidInputError, match="link_test_cost"):
        VerificationPolicy(link_test_cost=-0.1)
