"""Pricing the sequence DP's relaxed plans: the background pricer, the shared transfer tables, and the
bound with pricing on a second thread."""
from __future__ import annotations

import math
import threading

import pytest

from cost_models import comm
from planner.solver import api
from planner.solver.bound.lagrange import lagrange_bound
from planner.solver.objective import evaluate, violations
from planner.solver.search.pricer import BackgroundPricer
from tests.unit.bruteforce import brute_force
from tests.unit.test_solver_bruteforce import instance


def _blocked_pricer(backlog: int):
    """A pricer whose first item blocks until ``gate`` opens (so later items wait in its queue)."""
    priced, started, gate = [], threading.Event(), threading.Event()

    def price(item: int) -> None:
        if item == 1:
            started.set()
            assert gate.wait(10.0)
        priced.append((item, threading.current_thread().name))

    return BackgroundPricer(price, backlog=backlog), priced, started, gate


def test_pricer_prices_the_newest_first_and_drops_the_oldest_past_its_backlog():
    pricer, priced, started, gate = _blocked_pricer(backlog=3)
    pricer.submit(1)
    assert started.wait(10.0)
    for item in range(2, 11):
        pricer.submit(item)
    gate.set()
    while len(priced) < 4:
        threading.Event().wait(0.01)
    pricer.close()
    assert [i for i, _ in priced] == [1, 10, 9, 8]
    assert pricer.priced == 4 and pricer.dropped == 6


def test_pricer_close_prices_the_newest_waiting_items_on_the_callers_thread():
    pricer, priced, started, gate = _blocked_pricer(backlog=8)
    pricer.submit(1)
    assert started.wait(10.0)
    for item in range(2, 6):
        pricer.submit(item)
    threading.Timer(0.2, gate.set).start()  # opens after close() has told the thread to stop
    pricer.close(drain=2)
    here = threading.current_thread().name
    assert priced == [(1, "stagewise-pricer"), (5, here), (4, here)]
    assert pricer.dropped == 2


def test_a_job_runs_once_on_the_pricing_thread_before_the_waiting_items():
    pricer, priced, started, gate = _blocked_pricer(backlog=8)
    pricer.submit(1)
    assert started.wait(10.0)
    pricer.submit(2)
    pricer.then(lambda: priced.append(("job", threading.current_thread().name)))
    pricer.submit(3)
    gate.set()
    while len(priced) < 4:
        threading.Event().wait(0.01)
    pricer.close()
    assert [i for i, _ in priced] == [1, "job", 3, 2]
    assert {name for _, name in priced} == {"stagewise-pricer"}


def test_a_pricer_at_part_duty_prices_every_item_and_still_closes():
    """Resting between items (duty < 1) neither loses items nor keeps close() waiting on a rest."""
    done: list[int] = []
    pricer = BackgroundPricer(done.append, backlog=8, duty=0.01)  # rests 99x each item's time
    for item in range(3):
        pricer.submit(item)
    while len(done) < 3:
        threading.Event().wait(0.01)
    pricer.close()
    assert sorted(done) == [0, 1, 2] and pricer.priced == 3


def test_pricer_reraises_what_pricing_raised():
    tried = threading.Event()

    def price(item: int) -> None:
        tried.set()
        raise ValueError(f"bad plan {item}")

    pricer = BackgroundPricer(price, backlog=4)
    pricer.submit(7)
    assert tried.wait(10.0)
    with pytest.raises(ValueError, match="bad plan 7"):
        pricer.close()


def test_boundary_transfer_tables_equal_the_per_message_prices():
    chain, cluster, config, policy = instance(3)
    problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
    links = {lk for row in problem.links for lk in row if lk is not None}
    assert links
    for lk in links:
        table = problem.boundary_transfer_ms(lk)
        assert table is problem.boundary_transfer_ms(lk) and not table.flags.writeable
        assert table.tolist() == [comm.transfer_ms(problem.boundary_bytes(e), lk)
                                  for e in range(problem.num_blocks - 1)]


@pytest.mark.parametrize("seed", range(6))
def test_bound_with_a_pricing_thread_never_exceeds_the_enumerated_optimum(seed):
    chain, cluster, config, policy = instance(seed)
    problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
    best, _ = brute_force(problem)
    if not math.isfinite(best):
        return
    res = lagrange_bound(problem, incumbent_ms=best * 1.5, time_budget_s=0.5, workers=2)
    assert res.bound_ms <= best * (1 + 1e-9)
    assert res.placement is not None  # the thread's plans reach the result
    ev = evaluate(problem, res.placement)
    assert not violations(problem, res.placement, ev) and ev.step_ms == pytest.approx(res.step_ms)
    assert best * (1 - 1e-9) <= res.step_ms < best * 1.5
