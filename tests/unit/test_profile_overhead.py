"""The executor's CPU costs in a profile (MessageCost.executor_ms / executor_pass_ms): fitting them from the
overhead probe's report, the round trip through the profile JSON, and profiles taken before them."""
from __future__ import annotations

import pytest

from cost_models.measured import MessageCost, load_message_cost, with_executor_cost
from planner.errors import InvalidInputError
from planner.profiling.profile import ProfileSettings


def _report(**kw):
    return {"message_bytes": 2**20, "comm_cpu_per_message_ms": 0.25, "backend_cpu_per_message_ms": 0.5,
            "bookkeeping_per_pass_ms": 0.3, **kw}


def test_executor_cost_is_the_probe_per_message_beyond_the_bare_message_and_its_per_pass_bookkeeping():
    bare = MessageCost(send_ms=0.1, recv_ms=0.05, send_ms_per_mib=0.2, recv_ms_per_mib=0.4)
    cost = with_executor_cost(bare, _report())
    # a 1 MiB message costs the bare model (0.3 + 0.45) / 2 = 0.375 per end; the probe's executor 0.75
    assert cost.executor_ms == pytest.approx(0.75 - 0.375)
    assert cost.executor_pass_ms == pytest.approx(0.3)
    assert (cost.send_ms, cost.recv_ms, cost.send_ms_per_mib, cost.recv_ms_per_mib) == (0.1, 0.05, 0.2, 0.4)
    # a probe cheaper than the bare model adds nothing (never a negative cost)
    assert with_executor_cost(bare, _report(comm_cpu_per_message_ms=0.1, backend_cpu_per_message_ms=0.0)
                              ).executor_ms == 0.0


def test_the_profile_field_round_trips_and_old_profiles_load_without_it():
    cost = MessageCost(send_ms=0.1, recv_ms=0.05, send_ms_per_mib=0.2, recv_ms_per_mib=0.4, executor_ms=0.6,
                       executor_pass_ms=0.25)
    assert MessageCost.from_dict(cost.to_dict()) == cost
    assert load_message_cost({"p2p": {"messages": cost.to_dict()}}) == cost
    old = {"send_ms": 0.1, "recv_ms": 0.05, "send_ms_per_mib": 0.2, "recv_ms_per_mib": 0.4}
    loaded = load_message_cost({"p2p": {"messages": old}})
    assert loaded is not None and loaded.executor_ms == 0.0 and loaded.executor_pass_ms == 0.0
    assert loaded.send_cpu_ms(2**20) == pytest.approx(0.3)


@pytest.mark.parametrize("field", ["executor_ms", "executor_pass_ms"])
def test_negative_or_nan_executor_costs_are_refused(field):
    with pytest.raises(InvalidInputError):
        MessageCost(send_ms=0.1, recv_ms=0.1, **{field: -0.1})
    with pytest.raises(InvalidInputError):
        MessageCost.from_dict({"send_ms": 0.1, "recv_ms": 0.1, field: float("nan")})


def test_executor_probe_steps_setting():
    assert ProfileSettings().executor_steps >= 2 and ProfileSettings(executor_steps=0).executor_steps == 0
    for bad in (-1, 1):
        with pytest.raises(InvalidInputError):
            ProfileSettings(executor_steps=bad)
