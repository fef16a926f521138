"""Bad input and impossible requests: one clear error each, in terms the user knows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.solver import api, baseline_plans
from planner.solver.policy import VerificationPolicy
from tests.unit.solver_fixtures import random_chain

torch.set_num_threads(1)
LINKS = {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01}, "default": {"bandwidth_gbps": 10, "latency_ms": 1}}
CONFIG = TrainingConfig(global_batch=4, microbatch_size=1)


def cluster(*hosts) -> ClusterSpec:
    return parse_cluster({"name": "t", "hosts": list(hosts), "links": LINKS})


def host(name, gpu, count=1, *, trusted=True, trust=None, role=None):
    h = {"name": name, "region": "r", "trust": trust or ("operator" if trusted else name), "trusted": trusted,
         "devices": [{"type": gpu, "count": count}]}
    if role:
        h["role"] = role
    return h


def chain_of(total_params: float, blocks: int = 6):
    return random_chain(np.random.default_rng(0), blocks, param_scale=total_params / blocks, act_scale=1e6,
                        uniform=True)


def _message(exc: Exception) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


def test_empty_cluster_is_rejected_when_loaded():
    with pytest.raises(InvalidInputError, match="empty cluster"):
        parse_cluster({"name": "none", "hosts": [], "links": LINKS})


def test_cluster_without_stage_devices():
    only_verifier = cluster(host("v", "CPU", role="verifier"))
    with pytest.raises(InfeasiblePlanError) as err:
        api.solve(chain_of(1e8), only_verifier, CONFIG, time_limit_s=5, workers=1)
    assert "no device that can run a stage" in _message(err.value)


def test_model_larger_than_all_memory():
    small = cluster(host("a", "T4", 2), host("b", "T4", 1, trusted=False))
    with pytest.raises(InfeasiblePlanError) as err:
        api.solve(chain_of(5e9), small, CONFIG, time_limit_s=5, workers=1)  # 80 GB of Adam state vs 3 x 14.5 GB
    msg = _message(err.value)
    assert "the model needs 80.0 GB for weights" in msg and "usable memory is 46.4 GB" in msg
    assert "--optimizer sgd" in msg


def test_trusted_endpoints_without_trusted_devices():
    volunteers = cluster(host("a", "A100-80GB", trusted=False), host("b", "A100-80GB", trusted=False))
    with pytest.raises(InfeasiblePlanError) as err:
        api.solve(chain_of(1e9), volunteers, CONFIG, time_limit_s=5, workers=1)
    assert "requires trusted first and last stages but no trusted device exists" in _message(err.value)
    relaxed = VerificationPolicy(enabled=False)
    assert api.solve(chain_of(1e9), volunteers, CONFIG, relaxed, time_limit_s=5, workers=1).stages


def test_no_verifier_outside_the_senders_trust_domain():
    # Two small trusted T4s and an untrusted A100 in the same domain "lab": the model needs the A100,
    # whose boundaries only a device outside "lab" may check, and there is none.
    mixed = cluster(host("a", "T4", 2, trust="lab"), host("b", "A100-80GB", trusted=False, trust="lab"))
    with pytest.raises(InfeasiblePlanError) as err:
        api.solve(chain_of(2.5e9), mixed, CONFIG, time_limit_s=5, workers=1)
    assert "no verifier outside trust domain lab" in _message(err.value)


def test_bad_microbatch_candidates():
    ok = cluster(host("a", "A100-80GB", 2))
    with pytest.raises(InvalidInputError, match="a divisor of the global batch 4"):
        api.solve(chain_of(1e8), ok, CONFIG, time_limit_s=5, workers=1, microbatch_sizes=(3,))


def test_baseline_that_breaks_memory_says_so():
    uneven = cluster(host("a", "A100-80GB"), host("b", "T4"), host("c", "T4"), host("d", "A100-80GB"))
    chain = random_chain(np.random.default_rng(1), 8, param_scale=1.2e9, act_scale=1e6, uniform=True)
    with pytest.raises(InfeasiblePlanError, match="the uniform baseline has no valid plan here"):
        baseline_plans.baseline("uniform", chain, uneven, CONFIG, VerificationPolicy(enabled=False))
    sol = api.solve(chain, uneven, CONFIG, VerificationPolicy(enabled=False), time_limit_s=10, workers=1)
    assert sol.predicted_step_ms > 0


def test_one_trusted_device_cannot_be_both_ends():
    swarm = cluster(host("coord", "T4"), host("p1", "A100-80GB", trusted=False), host("p2", "A100-80GB", trusted=False))
    with pytest.raises(InfeasiblePlanError) as err:
        api.solve(chain_of(2e9), swarm, CONFIG, time_limit_s=5, workers=1)
    assert "one trusted device (coord/0, T4)" in _message(err.value)


def test_trusted_devices_too_small_for_both_ends():
    # Two trusted T4s and two untrusted A100s: each block needs 16 GB of Adam state, a T4 has 14.5 GB.
    ends = cluster(host("a", "T4", 2), host("p1", "A100-80GB", trusted=False), host("p2", "A100-80GB", trusted=False))
    chain = random_chain(np.random.default_rng(0), 4, param_scale=1e9, act_scale=1e6, uniform=True)
    with pytest.raises(InfeasiblePlanError) as err:
        api.solve(chain, ends, CONFIG, time_limit_s=5, workers=1)
    assert "requires a trusted first stage but no trusted device has room for it" in _message(err.value)
