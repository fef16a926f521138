"""The per-problem memo (``solver.problem_memo``): keyed by the problem's identity, never another problem's answer,
the oldest entry evicted past its size."""
from __future__ import annotations

from planner.solver.problem_memo import ProblemMemo


class _Problem:  # identity is all the memo reads
    pass


def test_a_value_is_computed_once_per_problem_and_key():
    memo: ProblemMemo[int] = ProblemMemo(kept=8)
    calls = []
    a, b = _Problem(), _Problem()
    assert memo.get(a, "k", lambda: calls.append("a") or 1) == 1
    assert memo.get(a, "k", lambda: calls.append("a again") or 99) == 1
    assert memo.get(b, "k", lambda: calls.append("b") or 2) == 2   # an equal key of another problem: its own value
    assert calls == ["a", "b"]


def test_the_oldest_entry_goes_and_its_problem_with_it():
    memo: ProblemMemo[int] = ProblemMemo(kept=2)
    problems = [_Problem() for _ in range(3)]
    for i, p in enumerate(problems):
        memo.get(p, "k", lambda i=i: i)
    assert len(memo) == 2
    assert memo.get(problems[0], "k", lambda: -1) == -1   # evicted: computed again
    assert memo.get(problems[2], "k", lambda: -2) == 2


def test_an_entry_holds_its_problem_so_its_id_is_not_reused():
    memo: ProblemMemo[int] = ProblemMemo(kept=4)
    memo.get(_Problem(), "k", lambda: 1)   # the caller drops its problem at once
    held = {id(p) for p in (_Problem() for _ in range(50))}  # ids freed by these may be reused, never the held one's
    assert len(memo) == 1 and next(iter(memo._entries))[0] not in held
