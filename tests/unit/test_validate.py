"""The program validator catches each kind of broken program, naming rank, index and instruction."""
from __future__ import annotations

import dataclasses

import pytest
from plan_fixtures import (
    compile_simple,
    free_cluster,
    golden_plan,
    solution,
    uniform_chain,
)

from planner.errors import InvalidInputError
from planner.instructions import parse_program
from planner.plan import Plan
from planner.solver.policy import VerificationPolicy
from planner.validate import find_problems, validate_programs


@pytest.fixture(scope="module")
def plan() -> Plan:
    return golden_plan()


def with_program(plan: Plan, rank: int, texts: list[str]) -> Plan:
    programs = list(plan.programs)
    programs[rank] = parse_program(texts)
    return dataclasses.replace(plan, programs=tuple(programs))


def texts(plan: Plan, rank: int) -> list[str]:
    return [str(i) for i in plan.programs[rank]]


def problems(plan: Plan) -> str:
    return "\n".join(p.message() for p in find_problems(plan))


def test_golden_plan_is_valid(plan):
    assert find_problems(plan) == []
    validate_programs(plan)


def test_send_with_no_receive(plan):
    prog = texts(plan, 1)
    prog.remove("1RECV_F1<0")
    bad = with_program(plan, 1, prog)
    with pytest.raises(InvalidInputError, match=r"rank 0 instruction #\d+ '0SEND_F1>1'.*received 0 time"):
        validate_programs(bad)
    assert "runs before receiving its input" in problems(bad)


def test_receive_with_no_send(plan):
    prog = texts(plan, 0)
    prog.remove("0SEND_F1>1")
    assert "'1RECV_F1<0': no rank 0 sends it" in problems(with_program(plan, 0, prog))


def test_duplicate_forward_and_missing_backward(plan):
    prog = texts(plan, 3)
    prog.insert(prog.index("2F1") + 1, "2F1")
    prog.remove("2B3")
    text = problems(with_program(plan, 3, prog))
    assert "F1 runs twice" in text
    assert "microbatch 3 has no B on stage 2" in text


def test_microbatch_on_the_wrong_replica(plan):
    prog = texts(plan, 2) + []
    prog.insert(0, "1F0")
    assert "microbatch 0 belongs to another replica" in problems(with_program(plan, 2, prog))


def test_backward_before_forward(plan):
    prog = texts(plan, 3)
    i, j = prog.index("2F0"), prog.index("2B0")
    prog[i], prog[j] = prog[j], prog[i]
    assert "backward of microbatch 0 before its forward" in problems(with_program(plan, 3, prog))


def test_step_ops(plan):
    prog = texts(plan, 1)
    prog.remove("1ALLREDUCE")
    assert "expected ALLREDUCE then OPTIM once each" in problems(with_program(plan, 1, prog))
    prog = texts(plan, 0)
    prog.remove("0OPTIM")
    prog.insert(0, "0OPTIM")
    assert "comes before the last backward" in problems(with_program(plan, 0, prog))


def test_verdict_required_before_use(plan):
    prog = texts(plan, 0)
    prog.remove("0VERDICT_B3<4")
    text = problems(with_program(plan, 0, prog))
    assert "uses boundary 0's tensor before its verdict" in text
    assert "'0VERIFY_B3<1>0'" in text  # the verdict the verifier sends is now never received


def test_verify_on_a_rank_that_is_not_the_verifier(plan):
    prog = texts(plan, 4) + ["1VERIFY_B0<3>1"]
    assert "rank 4 is not the verifier of boundary 1" in problems(with_program(plan, 4, prog))


def test_each_checked_microbatch_verified_once(plan):
    prog = texts(plan, 4)
    prog.remove("0VERIFY_B2<2>0")
    assert "boundary 0 (B) of microbatch 2 is verified 0 times" in problems(with_program(plan, 4, prog))


def test_in_flight_above_the_promise():
    # 1F1B promises min(S - k, n) on stage k; a GPipe order on stage 0 breaks it.
    ch = uniform_chain(2)
    plan = compile_simple(ch, free_cluster(2), solution([(0, 0), (1, 1)], [("h0/0",), ("h1/0",)], 4),
                          VerificationPolicy(enabled=False))
    prog = ["0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0F2", "0SEND_F2>1", "0F3", "0SEND_F3>1",
            "0RECV_B0<1", "0B0", "0RECV_B1<1", "0B1", "0RECV_B2<1", "0B2", "0RECV_B3<1", "0B3", "0OPTIM"]
    assert "holds 4 microbatches' activations at once, the plan promises at most 2" in \
        problems(with_program(plan, 0, prog))


def test_deadlock_is_found_and_located():
    ch = uniform_chain(2)
    plan = compile_simple(ch, free_cluster(2), solution([(0, 0), (1, 1)], [("h0/0",), ("h1/0",)], 2,
                                                        schedule="gpipe"), VerificationPolicy(enabled=False))
    # Rank 0 waits for mb 0's gradient before sending mb 1; rank 1 wants mb 1 before sending that gradient.
    plan = with_program(plan, 0, ["0F0", "0SEND_F0>1", "0RECV_B0<1", "0B0", "0F1", "0SEND_F1>1", "0RECV_B1<1",
                                  "0B1", "0OPTIM"])
    plan = with_program(plan, 1, ["1RECV_F0<0", "1F0", "1RECV_F1<0", "1F1", "1B0", "1SEND_B0>0", "1B1",
                                  "1SEND_B1>0", "1OPTIM"])
    with pytest.raises(InvalidInputError, match=r"rank 0 instruction #2 '0RECV_B0<1': deadlock"):
        validate_programs(plan)
    assert "rank 1 instruction #2 '1RECV_F1<0': deadlock" in problems(plan)


def test_receive_from_the_wrong_rank(plan):
    prog = texts(plan, 3)
    prog[prog.index("2RECV_F2<2")] = "2RECV_F2<1"
    assert "microbatch 2 of stage 1 runs on rank 2, not 1" in problems(with_program(plan, 3, prog))


def test_error_message_mentions_more_problems(plan):
    prog = texts(plan, 1)
    prog.remove("1RECV_F0<0")
    prog.remove("1RECV_F1<0")
    with pytest.raises(InvalidInputError, match=r"more problem\(s\).*fix: re-create the plan"):
        validate_programs(with_program(plan, 1, prog))
