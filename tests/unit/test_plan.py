"""The plan format: round trip, schema, and one clear error per kind of bad file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from plan_fixtures import GOLDEN_PATH, golden_plan

from planner.errors import InvalidInputError, PlanMismatchError
from planner.ir import Graph, Node, TensorMeta
from planner.plan import Plan
from planner.plan_json import SCHEMA_VERSION, plan_schema
from planner.plan_load import load_plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    return golden_plan()


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_save_load_round_trip(plan, tmp_path):
    path = plan.save(tmp_path / "sub" / "plan.json")
    assert load_plan(path) == plan
    assert Plan.from_dict(plan.to_dict()) == plan
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]  # no temp file left behind


def test_saved_programs_are_short_strings_one_list_per_rank(plan, tmp_path):
    data = json.loads(plan.save(tmp_path / "plan.json").read_text())
    assert len(data["programs"]) == len(data["ranks"]) == plan.num_ranks
    assert data["programs"][0][0] == "0F0"
    assert all(isinstance(s, str) for prog in data["programs"] for s in prog)
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["cluster"]["name"] == "test"  # self-contained: the cluster travels with the plan


def test_schema_is_valid_and_accepts_the_golden_file():
    jsonschema.Draft202012Validator.check_schema(plan_schema())
    jsonschema.validate(json.loads(GOLDEN_PATH.read_text()), plan_schema())


def test_stage_totals_and_queries(plan):
    st = plan.stages[1]
    assert (st.first_block, st.last_block) == (1, 2)
    assert st.block_names == ("layers.1", "layers.2")
    assert st.node_names == ("layers.1.mm", "layers.1.act", "layers.2.mm", "layers.2.act")
    assert st.param_count == sum(b.param_count for b in st.blocks)
    assert st.in_bytes == plan.stages[0].out_bytes
    assert plan.stage_ranks(1) == (1, 2)
    assert plan.owner(1, 2) == 2 and plan.owner(1, 3) == 1  # replicas interleave in proportion to their shares
    assert plan.ranks[-1].is_verifier and not plan.ranks[-1].runs_stage
    assert plan.chain().fingerprint == plan.model.fingerprint
    roles = [plan.rank_role(r) for r in range(plan.num_ranks)]
    assert roles[:4] == ["stage 0", "stage 1.0", "stage 1.1", "stage 2"] and roles[-1] == "verifier"


def test_truncated_json(plan, tmp_path):
    text = plan.save(tmp_path / "full.json").read_text()
    path = _write(tmp_path, text[: len(text) // 2])
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        load_plan(path)


def test_missing_file(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_plan(tmp_path / "nope.json")


def test_unknown_schema_version(plan, tmp_path):
    data = plan.to_dict()
    data["schema_version"] = 99
    with pytest.raises(PlanMismatchError, match=f"schema_version.*expected {SCHEMA_VERSION}.*found 99.*upgrade"):
        load_plan(_write(tmp_path, data))


def test_missing_field_names_its_path(plan, tmp_path):
    data = plan.to_dict()
    del data["ranks"][1]["device"]
    with pytest.raises(InvalidInputError, match=r"\$\.ranks\[1\].*'device' is a required property"):
        load_plan(_write(tmp_path, data))


def test_mistyped_field_names_its_path(plan, tmp_path):
    data = plan.to_dict()
    data["stages"][0]["blocks"][0]["fwd_flops"] = "lots"
    with pytest.raises(InvalidInputError, match=r"\$\.stages\[0\]\.blocks\[0\]\.fwd_flops"):
        load_plan(_write(tmp_path, data))


def test_rank_with_no_program(plan, tmp_path):
    data = plan.to_dict()
    data["programs"][2] = []
    with pytest.raises(InvalidInputError, match="rank 2 has no program"):
        load_plan(_write(tmp_path, data))
    data["programs"] = data["programs"][:-1]
    with pytest.raises(InvalidInputError, match=r"rank\(s\) 4 have no program"):
        load_plan(_write(tmp_path, data))


def test_bad_instruction_string_names_rank(plan, tmp_path):
    data = plan.to_dict()
    data["programs"][1][0] = "1RECV_F0<"
    with pytest.raises(InvalidInputError, match=r"programs\[1\]"):
        load_plan(_write(tmp_path, data))


def test_send_without_receive_is_rejected_on_load(plan, tmp_path):
    data = plan.to_dict()
    data["programs"][1].remove("1RECV_F0<0")
    with pytest.raises(InvalidInputError, match="invalid plan program: rank"):
        load_plan(_write(tmp_path, data))


def _graph(width: int) -> Graph:
    nodes = [Node(name="x", op="placeholder", kind="input", outputs=(TensorMeta(shape=(2, width), dtype="float32"),)),
             Node(name="y", op="relu", inputs=("x",), outputs=(TensorMeta(shape=(2, width), dtype="float32"),))]
    return Graph(name="g", source="test", nodes=nodes)


def test_model_fingerprint(plan, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    assert load_plan(path, model=plan.model.fingerprint) == plan
    with pytest.raises(PlanMismatchError, match="made for another model"):
        load_plan(path, model=_graph(8))
    with pytest.raises(PlanMismatchError, match="made for another model"):
        load_plan(path, model="0" * 64)
    with pytest.raises(InvalidInputError, match="Graph, a BlockChain or a fingerprint"):
        load_plan(path, model=42)


def test_plan_for_a_graph_matches_that_graph(plan, tmp_path):
    import dataclasses
    g = _graph(4)
    moved = dataclasses.replace(plan, model=dataclasses.replace(plan.model, fingerprint=g.fingerprint()))
    path = moved.save(tmp_path / "plan.json")
    assert load_plan(path, model=g).model.fingerprint == g.fingerprint()


def test_plan_constructor_checks_layout(plan):
    import dataclasses
    with pytest.raises(InvalidInputError, match="one program per rank"):
        dataclasses.replace(plan, programs=plan.programs + (plan.programs[0],))
    with pytest.raises(PlanMismatchError):
        dataclasses.replace(plan, schema_version=1)
    with pytest.raises(InvalidInputError, match="peak_mem_bytes"):
        dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, peak_mem_bytes=(1,)))


def test_non_string_instruction_is_rejected(plan, tmp_path):
    data = plan.to_dict()
    data["programs"][0][1] = 5
    with pytest.raises(InvalidInputError, match=r"programs\[0\].*instruction 5"):
        load_plan(_write(tmp_path, data))


def test_the_schema_names_every_verifier_setting():
    """The plan schema lists the verifier settings by name: it must follow VerifierConfig."""
    from planner.verifier_config import VerifierConfig

    names = plan_schema()["properties"]["verifier_config"]["propertyNames"]["enum"]
    assert sorted(names) == sorted(VerifierConfig.__dataclass_fields__)


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d["policy"].update(verifier_placement="stage"), "verifier verifier/0 runs no stage (policy: stage)"),
    (lambda d: [h.update(trust="operator") for h in d["cluster"]["hosts"] if h["name"] == "worker-c"],
     "verifier verifier/0 of boundary 0 is inside the sender's trust domain operator"),
    (lambda d: [h.update(trusted=False) for h in d["cluster"]["hosts"] if h["name"] == "trusted-a"],
     "stage 0 is an endpoint but runs on untrusted trusted-a/0"),
])
def test_a_plan_edited_against_its_trust_policy_is_refused_at_load(tmp_path, edit, problem):
    """The trust and coverage check of plan time runs again on the file as read."""
    data = json.loads(GOLDEN_PATH.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInputError, match="breaks its trust policy: " + re.escape(problem)):
        load_plan(path)
