"""The fill bound (``bound.fill``) keeps its values: on 36 random problems (wide-area pools of 2-13 devices,
random chains of 3-48 blocks, verification off / on / with trusted ends, recomputation, GPipe, int8
all-reduces), the bound and each of its tests' least ``B`` and count of feasibility tests are those recorded
in ``data/fill_bound_values.json``, written by the plain per-block implementation before the tabled one: a
faster test must decide every ``B`` the same. Each case records a fingerprint of the cost tables it was built
from, so a change there (not in the bound) says so; then regenerate, and review the diff:
``python tests/unit/test_fill_bound_values.py --write``."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from cost_models.training import TrainingConfig
from planner.solver.bound import fill
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import Problem, bound_problem, recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from tests.unit.program_fixtures import wide_area_cluster
from tests.unit.solver_fixtures import random_chain

VALUES_PATH = Path(__file__).resolve().parent / "data" / "fill_bound_values.json"
REL = 1e-9


def cases() -> list[tuple[str, Problem]]:
    """32 problems of 3-19 blocks, then 4 of 24-48, every option varied across them."""
    out = []
    for k in range(36):
        rng = np.random.default_rng(9000 + k)
        L = int(rng.integers(3, 20)) if k < 32 else (24, 32, 40, 48)[k - 32]
        cluster = wide_area_cluster(rng, int(rng.integers(2, 14)))
        long = k >= 32  # small blocks: a long chain spread over the pool
        chain = random_chain(rng, L, param_scale=2e7 if long else float(rng.choice([2e7, 1e8, 6e8])),
                             act_scale=5e7 if long else float(rng.choice([5e7, 2e8, 1.2e10])),
                             out_scale=1e6 if long else float(rng.choice([1e6, 1e7])))
        config = TrainingConfig(global_batch=int(rng.choice([4, 16, 32])), microbatch_size=1,
                                schedule="gpipe" if k % 4 == 3 else "1f1b", compress="int8" if k % 7 == 5 else "none")
        policy = VerificationPolicy(enabled=False) if k % 3 == 0 else VerificationPolicy(trusted_endpoints=k % 3 == 1)
        problem = build_problem(scale_chain(chain, 1), cluster, config, policy)
        out.append((f"{k}-L{L}", recompute_problem(problem) if k % 5 == 4 else problem))
    return out


def fingerprint(problem: Problem) -> str:
    """The cost tables the bound reads (rounded: a hair of float noise is no change)."""
    p = bound_problem(problem)
    L = p.num_blocks
    links = [[lk.bandwidth_gbps, lk.latency_ms] if lk is not None else [-1.0, -1.0] for row in p.links for lk in row]
    parts = [p.time_ms, p.bwd_ms if p.bwd_ms is not None else [], p.param_count, p.act_bytes, links,
             [p.num_microbatches, p.state_bytes_per_param, p.grad_bytes_per_param],
             [[c.count, c.mem_bytes, c.trusted, c.stage_capable, p.range_optim_ms(0, L - 1, c.index)]
              for c in p.classes]]
    text = repr([np.round(np.asarray(x, dtype=float), 6).tolist() for x in parts]) + p.compress + repr(p.policy)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def record(problem: Problem) -> dict:
    """The bound, and per split of the kinds and tracked state (as ``fill_bound_ms`` takes them) its test's
    least ``B`` from 0 and the feasibility tests it ran."""
    p = bound_problem(problem)
    stage = [c.index for c in p.classes if c.stage_capable]
    kinds = fill._kinds(p, stage)
    tests = []
    for cut in range(1, min(len(kinds), fill.MAX_SPLITS + 1) + (len(kinds) == 1)):
        fast = fill._Group.of(p, [c for k in kinds[:cut] for c in k])
        slow = fill._Group.of(p, [c for k in kinds[cut:] for c in k])
        for track in ("stages", "slow") if slow.count else ("stages",):
            tracked = fill._Test.tracked(fast, slow, track)[0].count
            if (p.num_blocks + 1) ** 3 // 2 * (tracked + 1) ** 2 > fill.CELLS:
                continue
            test = fill._Test(p, stage, fast, slow, track)
            tests.append([cut, track, test.least_ms(0.0), test.tests])
    return {"fingerprint": fingerprint(problem), "bound": fill.fill_bound_ms(problem), "tests": tests}


def write(path: Path, values: dict[str, dict]) -> None:
    """One case a line (a diff shows the cases that moved)."""
    path.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in values.items()) + "\n}\n")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b))


def test_the_bound_and_its_tests_keep_their_values():
    expected = json.loads(VALUES_PATH.read_text())
    assert len(expected) == 36
    positive = 0
    for name, problem in cases():
        want, got = expected[name], record(problem)
        assert got["fingerprint"] == want["fingerprint"], f"{name}: the cost tables changed (module docstring)"
        assert _close(got["bound"], want["bound"]), (name, got["bound"], want["bound"])
        assert len(got["tests"]) == len(want["tests"]), name
        for g, w in zip(got["tests"], want["tests"]):
            assert g[:2] == w[:2] and g[3] == w[3] and _close(g[2], w[2]), (name, g, w)
        positive += want["bound"] > 0
    assert positive >= 30


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit(f"usage: python {sys.argv[0]} --write  (rewrites {VALUES_PATH})")
    VALUES_PATH.parent.mkdir(exist_ok=True)
    write(VALUES_PATH, {name: record(p) for name, p in cases()})
    print(f"wrote {VALUES_PATH}")
