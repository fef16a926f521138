"""Verdicts queued behind the verifier's own activations (``planner.solver.verdict_backlog``): a trusted stage-0
replica verifies every boundary of a replicated untrusted middle, its warm-up forwards outrun its 1 Gb/s link to
its stage-1 twin, and the verdict on that twin's first gradient waits behind them; the verifier's own first
backward waits on that gradient, and every check behind it in its program too. Priced 16% under its simulation
before (the SENTINEL-like pool's forced 4x4 grid the same way: 16.2% under)."""
from __future__ import annotations

import numpy as np
import torch

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.simulate import simulate
from planner.solver.objective import Placement, even_split, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import build_problem, scale_chain
from planner.solver.solution import StagePlacement, VerifierPlacement
from tests.unit.program_fixtures import _compiled
from tests.unit.solver_fixtures import random_chain

torch.set_num_threads(1)

DEVICES = (("dc0/0", "dc0/1"), ("v0/0", "v0/1"), ("v1/0", "v1/1"), ("dc1/0", "dc1/1"))


def _pool():
    hosts = [{"name": f"dc{i}", "region": "dc", "trust": "op", "trusted": True,
              "devices": [{"type": "A100-80GB", "count": 2}]} for i in range(2)]
    hosts += [{"name": f"v{i}", "region": "home", "trust": f"v{i}", "devices": [{"type": "RTX3090", "count": 2}]}
              for i in range(2)]
    return parse_cluster({"name": "mini-sentinel", "hosts": hosts,
                          "links": {"intra_host": {"bandwidth_gbps": 100.0, "latency_ms": 0.01},
                                    "default": {"bandwidth_gbps": 1.0, "latency_ms": 5.0}}})


def test_verdicts_behind_the_verifiers_own_activations_are_priced_as_they_run():
    cluster = _pool()
    chain = random_chain(np.random.default_rng(0), 8, param_scale=2e7, flop_scale=5e10, act_scale=5e7,
                         out_scale=4e6, uniform=True)
    config = TrainingConfig(global_batch=32, microbatch_size=1)
    policy = VerificationPolicy()
    problem = build_problem(scale_chain(chain, 1), cluster, config, policy)
    stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=devs, microbatches=even_split(32, 2))
                   for k, ((a, b), devs) in enumerate(zip(((0, 1), (2, 3), (4, 5), (6, 7)), DEVICES)))
    verifiers = (VerifierPlacement(boundary=0, device="dc0/0", directions=("act", "grad"), watch_only=("act",)),
                 VerifierPlacement(boundary=1, device="dc0/0", directions=("act", "grad")),
                 VerifierPlacement(boundary=2, device="dc0/0", directions=("act", "grad"), watch_only=("grad",)))
    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=32)
    assert not violations(problem, placement)
    priced, plan = _compiled(problem, placement, chain, cluster, config, policy)
    simulated = simulate(plan).step_ms
    assert abs(priced.step_ms - simulated) <= 0.05 * simulated, (priced.step_ms, simulated)
