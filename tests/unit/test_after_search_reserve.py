"""The work a free solve keeps for what follows it (issue 36: the plan within its limit + 5 s): its plan and the rivals
that can still win are compiled and simulated after the search, which no other budget counted (DT-FM worldwide:
~0.5 s of CPU a plan, 4 plans). ``solver_api.solve``'s ``after_plans`` keeps their predicted work
(``budget.compile_units`` at the size of the best plan found so far, no clock read) from the search's; a rival placed
as a plan already compiled is not compiled again."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.api import plan_chain
from planner.rivals import distinct
from planner.solver import api as solver_api
from planner.solver.api import AFTER_MAX_SHARE, _after_s
from planner.solver.policy import VerificationPolicy
from planner.solver.search import budget
from planner.solver.search.budget import UNITS_PER_S, compile_units
from tests.unit.solver_fixtures import random_chain, random_cluster


def _job(M: int, blocks: int, devices: int) -> SimpleNamespace:
    return SimpleNamespace(num_microbatches=M, num_blocks=blocks,
                           classes=[SimpleNamespace(count=devices, stage_capable=True),
                                    SimpleNamespace(count=5, stage_capable=False)])


def _outcome(M: int | None, S: int = 0, ms: float = 1.0) -> SimpleNamespace:
    placement = None if M is None else SimpleNamespace(num_microbatches=M, num_stages=S)
    return SimpleNamespace(placement=placement, program_ms=ms)


def test_the_reserve_is_the_best_plans_size_and_before_any_the_largest_the_problems_allow():
    jobs = [_job(512, 26, 64), _job(256, 26, 64)]
    # before any plan: the most microbatches, a stage per block (26 < 64 stage devices; the verifier host's not)
    assert _after_s([_outcome(None)], jobs, 4, 1e6) == pytest.approx(4 * compile_units(512, 26) / UNITS_PER_S)
    # then the cheapest plan's size, not the last found's
    found = [_outcome(512, 20, ms=9.0), _outcome(256, 8, ms=5.0), _outcome(None)]
    assert _after_s(found, jobs, 4, 1e6) == pytest.approx(4 * compile_units(256, 8) / UNITS_PER_S)
    # at most a share of the search's work; nothing when no plan follows
    assert _after_s(found, jobs, 4, 1.0) == pytest.approx(AFTER_MAX_SHARE)
    assert _after_s(found, jobs, 0, 30.0) == 0.0 and _after_s([], [], 4, 30.0) == 0.0


def test_before_any_plan_nothing_is_kept_while_other_problems_follow():
    """The reserve is sized once a plan is found: the largest plan the problems allow took the cap from the first
    count's share (DT-FM worldwide: 6.4 of 25.5 nominal s at 30 s, where its plan needs 5.3)."""
    jobs = [_job(512, 26, 64), _job(256, 26, 64)]
    assert _after_s([], jobs, 4, 1e6, last=False) == 0.0
    assert _after_s([_outcome(None)], jobs, 4, 1e6, last=True) == pytest.approx(4 * compile_units(512, 26) / UNITS_PER_S)
    found = [_outcome(256, 8, ms=5.0)]  # once one is found, its size whatever follows
    assert _after_s(found, jobs, 4, 1e6, last=False) == pytest.approx(4 * compile_units(256, 8) / UNITS_PER_S)


def _searches(monkeypatch) -> list[budget.Work]:
    """The top-level ``search`` budgets made from now on."""
    made: list[budget.Work] = []
    init = budget.Work.__init__

    def recording(self, seconds, **kw):
        init(self, seconds, **kw)
        if kw.get("parent") is None and kw.get("what") == "search":
            made.append(self)

    monkeypatch.setattr(budget.Work, "__init__", recording)
    return made


def test_a_solve_keeps_the_reserve_from_its_search_and_plans_the_same_twice(monkeypatch):
    rng = np.random.default_rng(3)
    chain, cluster = random_chain(rng, 24), random_cluster(rng, 10)  # a search that spends its whole limit
    config = TrainingConfig(global_batch=16, microbatch_size=1)
    made = _searches(monkeypatch)
    monkeypatch.setattr(solver_api, "beyond", lambda *a, **k: None)  # every count searched: none leaves its share
    # 3 s: room past the counts' floors (at 1 s its four problems' MIN_SHARE_S and the steps' own floors spend 1.6 s)
    plans = [solver_api.solve(chain, cluster, config, VerificationPolicy(), time_limit_s=3.0, workers=1,
                              microbatch_sizes=(1, 4), after_plans=after) for after in (0, 4, 4)]
    spent = [w.spent_s() for w in made]  # with the steps' side budgets: the solve's whole work
    # without a reserve the search spends its limit, and past it only by the last problem's steps' floors
    assert 2.95 <= spent[0] <= 3.3
    reserve = min(AFTER_MAX_SHARE * 3.0, 4 * compile_units(16, 1) / UNITS_PER_S)  # at least: 16 microbatches, 1 stage
    assert spent[1] <= spent[0] - reserve / 2 and spent[1] == spent[2]  # the reserve kept
    assert plans[1].stages == plans[2].stages and plans[1].predicted_step_ms == plans[2].predicted_step_ms


def test_a_rival_placed_as_a_plan_compiled_before_is_not_compiled_again():
    def solution(stages: tuple, ms: float, method: str) -> SimpleNamespace:
        return SimpleNamespace(stages=stages, verifiers=(), num_microbatches=8, schedule="1f1b", predicted_step_ms=ms,
                               method=method)

    found = [solution(("a",), 10.0, "grid shaped"), solution(("b",), 9.0, "reordered"),
             solution(("b",), 9.0, "shared"), solution(("c",), 10.5, "ppdp")]
    kept = distinct(solution(("a",), 10.0, "solver"), found)
    assert [s.method for s in kept] == ["reordered", "ppdp"]
    # another microbatch count or schedule is another plan
    other = [solution(("a",), 10.0, "M=16"), solution(("a",), 10.0, "gpipe")]
    other[0].num_microbatches, other[1].schedule = 16, "gpipe"
    assert distinct(solution(("a",), 10.0, "solver"), other) == other


@pytest.mark.slow
def test_a_free_plan_is_the_same_twice_with_its_reserve():
    rng = np.random.default_rng(13)
    chain, cluster = random_chain(rng, 8), random_cluster(rng, 5)
    plans = [plan_chain(chain, cluster, spec="tests:chain", global_batch=16, time_limit_s=1.0, workers=1)
             for _ in range(2)]
    assert plans[0].predicted.step_ms == plans[1].predicted.step_ms
    assert [r.device for r in plans[0].ranks] == [r.device for r in plans[1].ranks]
