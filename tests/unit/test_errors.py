"""Errors carry what was expected, what was found and how to fix it."""
from planner.errors import InfeasiblePlanError, InvalidInputError, PlannerError


def test_message_joins_parts():
    err = InvalidInputError("cluster.hosts[0].devices", expected="a list", found="a string", fix="use [..]")
    assert str(err) == "cluster.hosts[0].devices; expected a list; found a string; fix: use [..]"
    assert isinstance(err, PlannerError)
    assert err.expected == "a list"


def test_bare_message():
    assert str(InfeasiblePlanError("not enough memory")) == "not enough memory"
