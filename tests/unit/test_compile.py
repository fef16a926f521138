"""Compiling solutions into plans: rank layout, programs for both schedules, verification, golden file."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_fixtures import (
    GOLDEN_PATH,
    TEST_DEVICE,
    cluster,
    compile_simple,
    config,
    free_cluster,
    golden_plan,
    model_ref,
    solution,
    uniform_chain,
)

from planner.compile import compile_plan
from planner.errors import InvalidInputError, PlanMismatchError
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import VerifierPlacement
from planner.validate import find_problems

NO_CHECKS = VerificationPolicy(enabled=False)


def test_golden_plan_file_is_stable():
    """The format and the compiler's output stay put. After an intended change regenerate with
    `python tests/unit/plan_fixtures.py --write-golden` and review the diff."""
    expected = json.loads(GOLDEN_PATH.read_text())
    assert golden_plan().to_dict() == expected


def test_rank_layout_stages_then_replicas_then_verifier_only_ranks():
    ch = uniform_chain(4)
    cl = cluster([("a", TEST_DEVICE, 2), ("b", TEST_DEVICE, 2)], verifier_host=True, trusted=("a",))
    sol = solution([(0, 1), (2, 3)], [("a/0",), ("b/0", "b/1")], 5, splits=[(5,), (3, 2)],
                   verifiers=(VerifierPlacement(boundary=0, device="verifier/0"),))
    plan = compile_simple(ch, cl, sol)
    layout = [(r.rank, r.device, r.stage, r.replica, r.microbatches, r.verifies) for r in plan.ranks]
    # replicas take microbatches interleaved by their shares (3 and 2 of 5), not contiguous ranges
    assert layout == [(0, "a/0", 0, 0, (0, 1, 2, 3, 4), ()), (1, "b/0", 1, 0, (0, 2, 4), ()),
                      (2, "b/1", 1, 1, (1, 3), ()), (3, "verifier/0", None, None, (), (0,))]
    assert [r.max_in_flight for r in plan.ranks[:3]] == [2, 1, 1]  # no in-flight limits given: 1F1B's least
    assert plan.verifiers[0].rank == 3
    # microbatch 3 flows from stage 0 to replica 1 of stage 1 and its gradient comes back from there
    assert "0SEND_F3>2" in map(str, plan.programs[0]) and "0RECV_B3<2" in map(str, plan.programs[0])
    assert [str(i) for i in plan.programs[2][-2:]] == ["1ALLREDUCE", "1OPTIM"]
    assert str(plan.programs[0][-1]) == "0OPTIM" and "ALLREDUCE" not in {i.op for i in plan.programs[0]}


def test_gpipe_runs_every_forward_before_any_backward():
    ch = uniform_chain(2)
    plan = compile_simple(ch, free_cluster(2), solution([(0, 0), (1, 1)], [("h0/0",), ("h1/0",)], 3,
                                                        schedule="gpipe"), NO_CHECKS)
    for prog in plan.programs:
        compute = [str(i)[1:] for i in prog if i.op in ("F", "B")]
        assert compute == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_in_flight_limit_from_the_solution_is_kept():
    ch = uniform_chain(2)
    sol = solution([(0, 0), (1, 1)], [("h0/0",), ("h1/0",)], 6)
    sol = dataclasses.replace(sol, stages=(dataclasses.replace(sol.stages[0], in_flight=(4,)), sol.stages[1]))
    plan = compile_simple(ch, free_cluster(2), sol, NO_CHECKS)
    assert plan.ranks[0].max_in_flight == 4
    live = peak = 0
    for ins in plan.programs[0]:
        live += {"F": 1, "B": -1}.get(ins.op, 0)
        peak = max(peak, live)
    assert 2 < peak <= 4  # more than 1F1B's least (S - k = 2), never above the limit


def test_1f1b_warm_up_and_in_flight_per_stage():
    ch = uniform_chain(4)
    plan = compile_simple(ch, free_cluster(4), solution([(i, i) for i in range(4)], [(f"h{i}/0",) for i in range(4)],
                                                        8), NO_CHECKS)
    for k, prog in enumerate(plan.programs):
        compute = [str(i) for i in prog if i.op in ("F", "B")]
        first_b = next(j for j, c in enumerate(compute) if "B" in c)
        assert first_b == 4 - k  # S - k - 1 warm-up forwards, then the steady state's forward
        assert plan.ranks[k].max_in_flight == 4 - k


def test_verifier_on_the_consumer_checks_locally_without_messages():
    ch = uniform_chain(2)
    cl = cluster([("a", TEST_DEVICE, 1), ("b", TEST_DEVICE, 1)], trusted=("b",))
    sol = solution([(0, 0), (1, 1)], [("a/0",), ("b/0",)], 2,
                   verifiers=(VerifierPlacement(boundary=0, device="b/0", directions=("act",)),))
    plan = compile_simple(ch, cl, sol)
    assert plan.num_ranks == 2
    prog = [str(i) for i in plan.programs[1]]
    assert prog[:3] == ["1RECV_F0<0", "1VERIFY_F0", "1F0"]
    assert not any(i.op.startswith("VERDICT") for p in plan.programs for i in p)
    assert sum(i.op == "SEND_F" for i in plan.programs[0]) == 2  # no extra copies


def test_verifier_on_a_third_rank_gets_copies_and_sends_verdicts():
    ch = uniform_chain(3)
    cl = cluster([("a", TEST_DEVICE, 1), ("b", TEST_DEVICE, 1), ("c", TEST_DEVICE, 1)], trusted=("a", "c"))
    sol = solution([(0, 0), (1, 1), (2, 2)], [("a/0",), ("b/0",), ("c/0",)], 2,
                   verifiers=(VerifierPlacement(boundary=0, device="c/0", directions=("grad",)),))
    plan = compile_simple(ch, cl, sol)
    b, c, a = ([str(i) for i in plan.programs[r]] for r in (1, 2, 0))
    assert "1SEND_B0>0" in b and "1SEND_B0>2" in b  # the gradient to stage 0 and a copy to the verifier
    assert "0VERIFY_B0<1>0" in c
    assert a.index("0RECV_B0<1") < a.index("0VERDICT_B0<2") < a.index("0B0")


def test_both_schedules_compile_valid_programs():
    ch = uniform_chain(6)
    for schedule in ("gpipe", "1f1b"):
        sol = solution([(0, 1), (2, 3), (4, 5)], [("h0/0",), ("h1/0", "h2/0"), ("h3/0",)], 6, schedule=schedule)
        plan = compile_simple(ch, free_cluster(4), sol, NO_CHECKS)
        assert find_problems(plan) == []
        assert plan.schedule == schedule and plan.predicted.step_ms > 0


@st.composite
def layouts(draw):
    S = draw(st.integers(1, 4))
    M = draw(st.integers(1, 6))
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    devices, splits, next_dev = [], [], 0
    for _ in range(S):
        r = draw(st.integers(1, min(3, M)))
        cuts = sorted(draw(st.lists(st.integers(1, M - 1), min_size=r - 1, max_size=r - 1, unique=True))) \
            if r > 1 else []
        bounds = [0, *cuts, M]
        splits.append(tuple(b - a for a, b in zip(bounds, bounds[1:])))
        devices.append(tuple(f"h{next_dev + i}/0" for i in range(r)))
        next_dev += r
    all_devices = [d for ds in devices for d in ds] + ["verifier/0"]
    verifiers = []
    for b in range(S - 1):
        if draw(st.booleans()):
            dirs = draw(st.sampled_from([("act",), ("grad",), ("act", "grad")]))
            senders = (devices[b] if "act" in dirs else ()) + (devices[b + 1] if "grad" in dirs else ())
            if len(senders) > 1 and draw(st.booleans()):  # two verifiers split the boundary's senders
                cut = draw(st.integers(1, len(senders) - 1))
                sites = draw(st.lists(st.sampled_from(all_devices), min_size=2, max_size=2, unique=True))
                verifiers += [VerifierPlacement(boundary=b, device=site, directions=dirs, senders=part)
                              for site, part in zip(sites, (senders[:cut], senders[cut:]))]
                continue
            verifiers.append(VerifierPlacement(boundary=b, device=draw(st.sampled_from(all_devices)), directions=dirs))
    return S, M, schedule, devices, splits, tuple(verifiers), next_dev


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_any_replica_split_and_verifier_placement_compiles_without_deadlock(layout):
    S, M, schedule, devices, splits, verifiers, n_devices = layout
    ch = uniform_chain(S)
    cl = cluster([(f"h{i}", TEST_DEVICE, 1) for i in range(n_devices)], verifier_host=True)
    sol = solution([(k, k) for k in range(S)], devices, M, splits=splits, schedule=schedule, verifiers=verifiers)
    plan = compile_simple(ch, cl, sol)  # compile_plan validates (deadlock included) and simulates
    assert find_problems(plan) == []
    assert plan.predicted.step_ms > 0


def test_inconsistent_inputs_are_rejected():
    ch = uniform_chain(2)
    cl = free_cluster(2)
    sol = solution([(0, 0), (1, 1)], [("h0/0",), ("h1/0",)], 4)
    policy = VerificationPolicy()
    with pytest.raises(InvalidInputError, match="solution microbatches"):
        compile_plan(sol, ch, cl, config(8), policy, model_ref(ch))
    with pytest.raises(InvalidInputError, match="solution schedule"):
        compile_plan(sol, ch, cl, config(4, "gpipe"), policy, model_ref(ch))
    with pytest.raises(InvalidInputError, match="no device 'h9/0'"):
        compile_plan(solution([(0, 0), (1, 1)], [("h0/0",), ("h9/0",)], 4), ch, cl, config(4), policy,
                     model_ref(ch))
    with pytest.raises(InvalidInputError, match="blocks 0..2"):
        compile_plan(sol, uniform_chain(3), cl, config(4), policy, model_ref(uniform_chain(3)))
    other = uniform_chain(2, fwd_flops=7)
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        compile_plan(sol, ch, cl, config(4), policy, model_ref(other))
    with pytest.raises(InvalidInputError, match="boundary"):
        compile_plan(solution([(0, 0), (1, 1)], [("h0/0",), ("h1/0",)], 4,
                              verifiers=(VerifierPlacement(boundary=1, device="h0/0"),)),
                     ch, cl, config(4), policy, model_ref(ch))
