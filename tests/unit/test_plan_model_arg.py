"""load_plan(path, model=...) accepts the model in every form DESIGN.md shows."""
import pytest

import planner
from models.registry import build_model
from planner.api import plan_chain
from planner.errors import PlanMismatchError
from planner.model_io import load_chain


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    _, chain = load_chain("gpt-tiny", batch=1)
    plan = plan_chain(chain, None, spec="gpt-tiny", baseline="uniform")
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def test_module_pair_and_graph_are_accepted(plan_path):
    bundle = build_model("gpt-tiny", batch=1)
    assert planner.load_plan(plan_path, model=bundle.module).model.spec == "gpt-tiny"
    assert planner.load_plan(plan_path, model=(bundle.module, bundle.example_inputs)).num_stages >= 1


def test_another_model_is_refused(plan_path):
    other = build_model("llama-tiny", batch=1)
    with pytest.raises(PlanMismatchError, match="another model"):
        planner.load_plan(plan_path, model=other.module)
    wider = build_model("gpt-tiny", batch=4)  # same module, other input shape: another graph
    with pytest.raises(PlanMismatchError):
        planner.load_plan(plan_path, model=(wider.module, wider.example_inputs))
