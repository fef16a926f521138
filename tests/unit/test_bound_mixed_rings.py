"""The fill bound's mixed rings (``bound.fill._mixed_lines``: a stage holding devices of both groups, where some
partition's islands each hold one group's classes only, all-reduces over a link between islands) stay below every
enumerated plan of random pools of a fast and a slow GPU kind on separate hosts, and lift the bound where the
hosts' link is slow and the stages' gradients large."""
from __future__ import annotations

import numpy as np

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.solver.bound import fill, fill_dp, fill_rows
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import bound_problem, recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_bound_fill_route import _prices

HAIR = 1 + 1e-9


def _pool(rng: np.random.Generator):
    """A host of 1-2 A100s and one of 2-3 V100s (NVLink inside, 1-25 Gb/s between), 3-6 blocks of large
    gradients, 4 or 8 microbatches, no verification."""
    hosts = [{"name": "a", "region": "r", "trust": "op", "trusted": True,
              "devices": [{"type": "A100-40GB", "count": int(rng.integers(1, 3))}],
              "intra_host": {"bandwidth_gbps": 2400, "latency_ms": 0.005}},
             {"name": "v", "region": "r", "trust": "op", "trusted": True,
              "devices": [{"type": "V100-16GB", "count": int(rng.integers(2, 4))}],
              "intra_host": {"bandwidth_gbps": 1200, "latency_ms": 0.005}}]
    cluster = parse_cluster({"name": "mixed", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": float(rng.choice([1.0, 5.0, 25.0])),
                                                   "latency_ms": float(rng.choice([0.1, 5.0]))}}})
    chain = random_chain(rng, int(rng.integers(3, 7)), param_scale=float(rng.choice([5e7, 2e8])),
                         flop_scale=float(rng.choice([5e11, 3e12])), act_scale=5e7, out_scale=1e6, uniform=True)
    config = TrainingConfig(global_batch=int(rng.choice([4, 8])), microbatch_size=1,
                            schedule="gpipe" if rng.random() < 0.25 else "1f1b")
    return build_problem(scale_chain(chain, 1), cluster, config, VerificationPolicy(enabled=False)), cluster


def _without(problem, monkeypatch) -> float:
    """The bound with no mixed-ring lines (every stage's ring as ``Rings`` alone prices it)."""
    kept = fill_dp._mixed_lines

    def none(*args):
        alpha, beta = kept(*args)
        return alpha, np.full_like(beta, -np.inf)

    with monkeypatch.context() as m:
        m.setattr(fill_dp, "_mixed_lines", none)
        return fill_bound_ms(problem)


def test_below_every_enumerated_plan_and_lifts_the_bound(monkeypatch):
    checked = lifted = mixed = 0
    for seed in range(12):
        problem, cluster = _pool(np.random.default_rng(9100 + seed))
        for p in (problem, recompute_problem(problem)) if seed % 4 == 0 else (problem,):
            prices = _prices(p, cluster, max_stages=3)
            if not prices:
                continue
            bound, before = fill_bound_ms(p), _without(p, monkeypatch)
            assert before * (1 - 2 * fill.REL_TOL) <= bound <= min(prices) * HAIR, (seed, before, bound, min(prices))
            checked += 1
            lifted += bound > before * (1 + 1e-6)
        q = bound_problem(problem)
        stage = [c.index for c in q.classes if c.stage_capable]
        kinds = fill._kinds(q, stage)
        a, b = fill._Group.of(q, kinds[0]), fill._Group.of(q, kinds[1])
        _, beta = fill_rows._mixed_lines(q, stage, a, b, 4)
        mixed += bool(np.isfinite(beta[2]).any())  # the hosts split the kinds: a line for a ring of 2
    assert checked >= 8 and mixed == 12 and lifted >= 2, (checked, mixed, lifted)


def test_only_the_hosts_link_where_a_host_holds_both_kinds():
    """One host of both kinds: only the partition of single devices separates them, so a mixed stage's ring is
    priced at the host's own link (100 Gb/s), not the 1 Gb/s between hosts."""
    hosts = [{"name": "h", "region": "r", "trust": "op", "trusted": True,
              "devices": [{"type": "A100-40GB", "count": 1}, {"type": "V100-16GB", "count": 2}]},
             {"name": "g", "region": "r", "trust": "op", "trusted": True,
              "devices": [{"type": "V100-16GB", "count": 2}]}]
    cluster = parse_cluster({"name": "one", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": 1.0, "latency_ms": 5.0}}})
    chain = random_chain(np.random.default_rng(1), 4, param_scale=2e8, act_scale=5e7, out_scale=1e6, uniform=True)
    q = bound_problem(build_problem(scale_chain(chain, 1), cluster, TrainingConfig(global_batch=4, microbatch_size=1),
                                    VerificationPolicy(enabled=False)))
    stage = [c.index for c in q.classes if c.stage_capable]
    kinds = fill._kinds(q, stage)
    assert len(kinds) == 2
    alpha, beta = fill_rows._mixed_lines(q, stage, fill._Group.of(q, kinds[0]), fill._Group.of(q, kinds[1]), 4)
    assert np.isfinite(beta[2]).any()
    assert alpha[2].max() <= 1e3 / (100e9 / 8) * HAIR  # a ring of 2: its bytes once over the fastest link
