"""Errors carry what was expected, what was found and how to fix it."""
from planner.errors import InfeasiblePlanError, InvalidInputError, PlannerError, first_line


def test_message_joins_parts():
    err = InvalidInputError("cluster.hosts[0].devices", expected="a list", found="a string", fix="use [..]")
    assert str(err) == "cluster.hosts[0].devices; expected a list; found a string; fix: use [..]"
    assert isinstance(err, PlannerError)
    assert err.expected == "a list"


def test_bare_message():
    assert str(InfeasiblePlanError("not enough memory")) == "not enough memory"


def test_an_exceptions_first_line_stands_for_it():
    assert first_line(ValueError("bad header\n  File x.py, line 3\n")) == "bad header"
    assert first_line(OSError("  \n")) == "OSError with no message"
