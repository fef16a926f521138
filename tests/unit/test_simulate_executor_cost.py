"""The simulator charges the runtime executor's own CPU time (MessageCost.executor_ms / executor_pass_ms)."""
from __future__ import annotations

import pytest
from plan_fixtures import compile_simple, free_cluster, solution, uniform_chain

from cost_models.measured import MessageCost
from planner.instruction_costs import CostModel
from planner.simulate import simulate
from planner.solver.policy import VerificationPolicy


def _two_ranks(M: int = 1):
    return compile_simple(uniform_chain(2, out_bytes=2**20), free_cluster(2),
                          solution([(0, 0), (1, 1)], [("h0/0",), ("h1/0",)], M, schedule="1f1b"),
                          VerificationPolicy(enabled=False))


def test_each_message_instruction_pays_the_executor_cost_at_its_end():
    """S = 2, M = 1, free links: the critical path is F0, send, receive, F1, B1, send, receive, B0, so
    the pipeline grows by 2 (s + r) + 4 e over the bare messages' priced one (e per message end), and by
    4 p with p per pass (all four passes are on it)."""
    plan = _two_ranks()
    nbytes = CostModel.for_plan(plan).boundary_bytes[0]
    bare = MessageCost(send_ms=0.5, recv_ms=0.25, send_ms_per_mib=1.0, recv_ms_per_mib=2.0)
    s, r = 0.5 + nbytes / 2**20, 0.25 + 2.0 * nbytes / 2**20
    e, p = 0.75, 0.125
    plain = simulate(plan)
    priced_bare = simulate(plan, messages=bare)
    priced = simulate(plan, messages=MessageCost(send_ms=0.5, recv_ms=0.25, send_ms_per_mib=1.0,
                                                 recv_ms_per_mib=2.0, executor_ms=e))
    assert priced_bare.pipeline_ms == pytest.approx(plain.pipeline_ms + 2 * (s + r), rel=1e-9)
    assert priced.pipeline_ms == pytest.approx(priced_bare.pipeline_ms + 4 * e, rel=1e-9)
    boxes = sorted((ev.start_ms, ev.end_ms - ev.start_ms) for ev in priced.events if ev.kind == "message")
    assert [d for _, d in boxes] == pytest.approx([s + e, r + e, s + e, r + e])
    # each rank is busy for its two passes' worth of work, plus one send and one receive with e each
    assert priced.busy_ms[0] == pytest.approx(plain.busy_ms[0] + s + r + 2 * e, rel=1e-9)

    with_pass = simulate(plan, messages=MessageCost(send_ms=0.5, recv_ms=0.25, send_ms_per_mib=1.0,
                                                    recv_ms_per_mib=2.0, executor_ms=e, executor_pass_ms=p))
    assert with_pass.pipeline_ms == pytest.approx(priced.pipeline_ms + 4 * p, rel=1e-9)
    assert with_pass.compute_ms[1] == pytest.approx(priced.compute_ms[1] + 2 * p, rel=1e-9)


def test_on_one_shared_core_the_step_is_all_work_plus_every_executor_charge():
    """One core never idles with free links: passes + optimizer + each message end's (bare + e) + p per pass."""
    M = 3
    plan = _two_ranks(M)
    costs = CostModel.for_plan(plan)
    work = sum(M * (costs.compute_ms(r, "F") + costs.compute_ms(r, "B")) + costs.optim_ms(r) for r in range(2))
    e, p = 0.4, 0.1
    cost = MessageCost(send_ms=0.3, recv_ms=0.2, executor_ms=e, executor_pass_ms=p)
    ends = 2 * 2 * M  # a forward and a backward message per microbatch, each with a send and a receive
    passes = 2 * 2 * M
    assert simulate(plan, cores=1, messages=cost).step_ms == pytest.approx(
        work + ends / 2 * (0.3 + 0.2) + ends * e + passes * p, rel=1e-12)


def test_without_messages_the_executor_is_not_priced():
    plan = _two_ranks(2)
    assert simulate(plan).step_ms == pytest.approx(simulate(plan, messages=None).step_ms)
    zero = MessageCost(send_ms=0.0, recv_ms=0.0)
    assert simulate(plan, messages=zero).step_ms == pytest.approx(simulate(plan).step_ms)
