"""Several verifiers share one boundary's replicas (issue 36): each watches a subset of the senders. The value
(default: all senders, so older plans read as before), compile (each replica copies only to the verifier that
covers it), the plan file, and the errors of a bad split."""
from __future__ import annotations

import json

import pytest
from plan_fixtures import TEST_DEVICE, cluster, compile_simple, solution, uniform_chain

from planner.errors import InvalidInputError
from planner.plan_load import load_plan
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import VerifierPlacement
from planner.validate import find_problems

A, B, C, D = "a/0", "b/0", "c/0", "d/0"   # a: stage 0 (trusted), b and c: stage 1's replicas, d: stage 2 (trusted)


def _cluster():
    return cluster([(h, TEST_DEVICE, 1) for h in "abcd"], trusted=("a", "d"))


def _split(*verifiers: VerifierPlacement, M: int = 4):
    return solution([(0, 0), (1, 1), (2, 2)], [(A,), (B, C), (D,)], M, verifiers=verifiers)


SPLIT = (VerifierPlacement(boundary=1, device=D, directions=("act",), senders=(B,)),
         VerifierPlacement(boundary=1, device=A, directions=("act",), senders=(C,)),
         VerifierPlacement(boundary=0, device=A, directions=("grad",)))


def test_a_verifier_without_senders_covers_every_sender():
    assert VerifierPlacement(boundary=0, device=A).covers(B)
    v = VerifierPlacement(boundary=0, device=A, senders=(B,))
    assert v.covers(B) and not v.covers(C)


def test_each_replica_copies_only_to_the_verifier_that_covers_it():
    plan = compile_simple(uniform_chain(3), _cluster(), _split(*SPLIT))
    assert find_problems(plan) == []
    b, c = ([str(i) for i in plan.programs[r]] for r in (1, 2))
    assert not [i for i in b if i.startswith("1SEND_F") and i.endswith(">0")]   # b is checked by d, the consumer
    assert sum(i.startswith("1SEND_F") and i.endswith(">0") for i in c) == 2    # c copies its two to a
    assert sum(i.startswith("2VERIFY_F") for i in (str(x) for x in plan.programs[0])) == 2
    assert sum(i.startswith("2VERIFY_F") for i in (str(x) for x in plan.programs[3])) == 2
    assert plan.ranks[0].verifies == (0, 1) and plan.ranks[3].verifies == (1,)
    assert [v.label() for v in plan.verifiers if v.boundary == 1] == ["act; from c/0", "act; from b/0"]


def test_senders_survive_the_plan_file_and_are_absent_where_a_verifier_watches_all(tmp_path):
    plan = compile_simple(uniform_chain(3), _cluster(), _split(*SPLIT))
    path = plan.save(tmp_path / "plan.json")
    rows = json.loads(path.read_text())["verifiers"]
    assert [r.get("senders") for r in rows] == [None, ["c/0"], ["b/0"]]
    assert load_plan(path).verifiers == plan.verifiers


@pytest.mark.parametrize("verifiers, match", [
    ((VerifierPlacement(boundary=1, device=D, directions=("act",)),
      VerifierPlacement(boundary=1, device=A, directions=("act",), senders=(C,))), "watching every sender"),
    ((VerifierPlacement(boundary=1, device=D, directions=("act",), senders=(B, C)),
      VerifierPlacement(boundary=1, device=A, directions=("act",), senders=(C,))), "share a sender"),
    ((VerifierPlacement(boundary=1, device=D, directions=("act",), senders=(B,)),
      VerifierPlacement(boundary=1, device=D, directions=("act",), senders=(C,))), "two verifiers on one device"),
    ((VerifierPlacement(boundary=1, device=D, directions=("act",), senders=("x/0",)),), "senders"),
])
def test_a_bad_split_is_refused_at_compile(verifiers, match):
    with pytest.raises(InvalidInputError, match=match):
        compile_simple(uniform_chain(3), _cluster(), _split(*verifiers), VerificationPolicy())


def test_the_trust_check_wants_every_untrusted_sender_covered():
    from planner.check import trust_problems
    policy = VerificationPolicy(trusted_endpoints=False)
    only_b = (VerifierPlacement(boundary=1, device=D, directions=("act",), senders=(B,)),
              VerifierPlacement(boundary=0, device=A, directions=("grad",)))
    assert trust_problems(((A,), (B, C), (D,)), SPLIT, _cluster(), policy) == []
    assert trust_problems(((A,), (B, C), (D,)), only_b, _cluster(), policy) == \
        ["boundary 1 (act): untrusted sender c/0 has no verifier"]


def test_the_solver_splits_a_boundary_only_where_its_programs_price_faster():
    """Random SENTINEL-like pools in small (untrusted replicated middles, the trusted ends' devices the only
    verifier sites): a kept split never prices slower, and where one verifier's checks paced the step the split
    simulates faster too."""
    from planner.simulate import simulate
    from planner.solver.objective import price_program, violations
    from planner.solver.shared_verifiers import split_shared
    from tests.unit.program_fixtures import _compiled, replicated_untrusted_placement
    gains = []
    for seed in range(120):
        drawn = replicated_untrusted_placement(seed, max_stages=4)
        if drawn is None:
            continue
        problem, placement, *rest = drawn
        split = split_shared(problem, placement)
        if split is placement:
            continue
        assert violations(problem, split) == ()
        assert price_program(problem, split).step_ms < price_program(problem, placement).step_ms
        gains.append(simulate(_compiled(problem, split, *rest)[1]).step_ms /
                     simulate(_compiled(problem, placement, *rest)[1]).step_ms)
    assert len(gains) >= 10 and min(gains) < 0.85, sorted(gains)[:4]
    assert sum(g < 1.0 for g in gains) >= 0.7 * len(gains), gains


def test_show_lists_every_verifier_of_a_shared_boundary():
    from planner.commands.show import stage_table
    from planner.instruction_costs import CostModel
    plan = compile_simple(uniform_chain(3), _cluster(), _split(*SPLIT))
    table = stage_table(plan, CostModel.for_plan(plan))
    assert list(table.columns[-1].cells)[1] == "r0 act; from c/0; r3 act; from b/0"
