"""The Gantt chart draws every event kind the simulator produces, with a legend entry for each."""
from __future__ import annotations

from cost_models.measured import MessageCost
from planner.gantt import draw
from planner.simulate import simulate
from tests.unit.plan_fixtures import golden_plan


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_message_events_are_drawn_and_named_in_the_legend():
    plan = golden_plan()
    result = simulate(plan, messages=MessageCost(send_ms=0.2, recv_ms=0.3))
    assert any(ev.kind == "message" for ev in result.events)
    assert "message CPU" in _legend_labels(draw(plan, result))


def test_legend_leaves_out_message_cpu_when_messages_are_not_priced():
    plan = golden_plan()
    result = simulate(plan)
    assert not any(ev.kind == "message" for ev in result.events)
    labels = _legend_labels(draw(plan, result))
    assert "message CPU" not in labels and "forward" in labels
