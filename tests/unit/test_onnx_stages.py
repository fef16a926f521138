"""Stage subgraphs of a plan as ONNX files: run in sequence they compute the whole model; the manifest says
which stage feeds which; bad external data fails at trace; an ONNX plan is not run by the torch runtime."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from models.registry import build_model
from planner.api import plan_chain
from planner.coarsen import coarsen
from planner.errors import InvalidInputError, PlanMismatchError
from planner.model_io import load_chain
from planner.onnx_import import export_onnx, import_onnx, load_onnx
from planner.onnx_stages import (
    MANIFEST,
    MODEL_INPUT,
    check_output_folder,
    export_stages,
    stage_cuts,
)
from planner.runtime.launcher.launch import preflight
from planner.runtime.options import RunOptions
from planner.trace import trace

CLUSTER = Path(__file__).resolve().parents[2] / "cost_models" / "clusters" / "box-8gpu.yaml"
BATCH, SEQ = 2, 16


@pytest.fixture(scope="module")
def onnx_plan(tmp_path_factory):
    """gpt-tiny exported to ONNX and planned as 3 stages from the file; the plan saved beside it."""
    folder = tmp_path_factory.mktemp("gpt")
    bundle = build_model("gpt-tiny", batch=BATCH, seq=SEQ, device="cpu")
    model_path = export_onnx(bundle.module, bundle.example_inputs, folder / "gpt-tiny.onnx")
    _, chain = load_chain(str(model_path))
    plan = plan_chain(chain, CLUSTER, spec=str(model_path), stages=3, global_batch=2 * BATCH, time_limit_s=5)
    plan.save(folder / "plan.json")
    return plan, folder


def _run_stages(folder: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run every stage file in order with onnx.reference, feeding each input from the stage the manifest names."""
    manifest = json.loads((folder / MANIFEST).read_text())
    values = dict(feeds)
    for stage in manifest["stages"]:
        session = ReferenceEvaluator(str(folder / stage["file"]))
        assert list(session.input_names) == [t["name"] for t in stage["inputs"]]
        outs = session.run(None, {t["name"]: values[t["name"]] for t in stage["inputs"]})
        values.update(zip((t["name"] for t in stage["outputs"]), outs))
    return {t["name"]: values[t["name"]] for t in manifest["outputs"]}


def test_stage_files_in_sequence_compute_the_whole_onnx_model(onnx_plan, tmp_path):
    plan, folder = onnx_plan
    out = export_stages(plan, tmp_path / "stages", plan_path=folder / "plan.json")
    assert [f.name for f in out.files] == ["stage0.onnx", "stage1.onnx", "stage2.onnx"]
    idx = np.random.default_rng(0).integers(0, 256, size=(BATCH, SEQ), dtype=np.int64)
    whole = ReferenceEvaluator(str(folder / "gpt-tiny.onnx")).run(None, {"idx": idx})
    staged = _run_stages(tmp_path / "stages", {"idx": idx})
    assert len(staged) == len(whole) == 1
    got = next(iter(staged.values()))
    assert got.shape == (BATCH, SEQ, 256) and whole[0].std() > 0.01
    np.testing.assert_allclose(got, whole[0], rtol=1e-5, atol=1e-6)


def test_manifest_lists_files_boundaries_and_their_producers(onnx_plan, tmp_path):
    plan, folder = onnx_plan
    export_stages(plan, tmp_path / "stages", plan_path=folder / "plan.json")
    manifest = json.loads((tmp_path / "stages" / MANIFEST).read_text())
    assert manifest["model"]["fingerprint"] == plan.model.fingerprint
    assert manifest["inputs"] == [{"name": "idx", "shape": [BATCH, SEQ], "dtype": "int64"}]
    assert [s["blocks"] for s in manifest["stages"]] == [list(st.block_names) for st in plan.stages]
    assert sorted(p.name for p in (tmp_path / "stages").iterdir()) == sorted(
        [MANIFEST] + [s["file"] for s in manifest["stages"]] + [s["data"] for s in manifest["stages"] if s["data"]])
    made_by = {t["name"]: MODEL_INPUT for t in manifest["inputs"]}
    for stage in manifest["stages"]:
        model = onnx.load(str(tmp_path / "stages" / stage["file"]), load_external_data=False)
        assert [o.name for o in model.graph.output] == [t["name"] for t in stage["outputs"]]
        for t in stage["inputs"]:  # every input comes from the model or an earlier stage's output, shapes agree
            assert t["from_stage"] == made_by[t["name"]] < stage["index"]
        for t in stage["outputs"]:
            made_by[t["name"]] = stage["index"]
            if not t["model_output"]:  # the residual stream between transformer layers: [B, T, d]
                assert t["shape"] == [BATCH, SEQ, 64] and t["dtype"] == "float32" and t["to_stages"]
    assert manifest["outputs"][0]["from_stage"] == 2 and manifest["outputs"][0]["shape"] == [BATCH, SEQ, 256]


def test_a_torch_plan_is_exported_through_torch_onnx_and_matches_the_torch_model(tmp_path):
    bundle = build_model("gpt-tiny", batch=1, seq=SEQ, device="meta")
    chain = coarsen(trace(bundle.module, bundle.example_inputs, name="gpt-tiny"))
    plan = plan_chain(chain, CLUSTER, spec="gpt-tiny", seq=SEQ, stages=2, global_batch=2, time_limit_s=5)
    out = export_stages(plan, tmp_path / "stages", seed=3)
    assert len(out.files) == 2 and out.manifest["source"].startswith("torch.onnx export")
    real = build_model("gpt-tiny", batch=plan.config.microbatch_size, seq=SEQ, device="cpu", seed=3)
    with torch.no_grad():
        expected = real.module.eval()(*real.example_inputs).numpy()
    staged = _run_stages(tmp_path / "stages", {out.manifest["inputs"][0]["name"]: real.example_inputs[0].numpy()})
    np.testing.assert_allclose(next(iter(staged.values())), expected, rtol=1e-4, atol=1e-5)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the torch export was temporary


def _skip_model(tmp_path: Path) -> Path:
    """x -> A -> a -> B -> b; C reads a and b: the last stage reads from both earlier stages."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 3], np.eye(3, dtype=np.float32).ravel().tolist())
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="A"),
             helper.make_node("Relu", ["a"], ["b"], name="B"),
             helper.make_node("Add", ["a", "b"], ["c"], name="C")]
    graph = helper.make_graph(nodes, "skip", [x], [c], initializer=[w])
    path = tmp_path / "skip.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    return path


def test_a_value_skipping_a_stage_feeds_its_reader_directly(tmp_path):
    source = import_onnx(_skip_model(tmp_path))
    cuts = stage_cuts(source, [frozenset({"A"}), frozenset({"B"}), frozenset({"C"})], [("a",), ("b",), ("c",)])
    assert [(c.inputs, c.outputs) for c in cuts] == [(("x",), ("a",)), (("a",), ("b",)), (("a", "b"), ("c",))]
    with pytest.raises(InvalidInputError, match="in none"):  # a node the plan does not place
        stage_cuts(source, [frozenset({"A"}), frozenset({"C"})], [("a",), ("c",)])


def _copy_model(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for name in ("gpt-tiny.onnx", "gpt-tiny.onnx.data"):
        shutil.copy(folder / name, dest / name)
    return dest / "gpt-tiny.onnx"


def test_truncated_external_data_fails_at_trace_naming_the_sizes(onnx_plan, tmp_path):
    _, folder = onnx_plan
    model = _copy_model(folder, tmp_path / "m")
    data = model.with_name("gpt-tiny.onnx.data")
    full = data.stat().st_size
    data.write_bytes(data.read_bytes()[: full // 2])
    with pytest.raises(InvalidInputError) as err:
        load_onnx(model)
    message = str(err.value)
    assert "gpt-tiny.onnx.data" in message and "truncated" in message
    assert f"{full:,} bytes" in message and f"{full // 2:,} bytes" in message


def test_missing_external_data_fails_at_trace(onnx_plan, tmp_path):
    _, folder = onnx_plan
    model = _copy_model(folder, tmp_path / "m")
    model.with_name("gpt-tiny.onnx.data").unlink()
    with pytest.raises(InvalidInputError, match=r"gpt-tiny\.onnx\.data.*no such file"):
        load_chain(str(model))


def test_an_onnx_plan_is_refused_by_run_with_what_to_do_instead(onnx_plan):
    _, folder = onnx_plan
    with pytest.raises(InvalidInputError) as err:
        preflight(RunOptions(plan=str(folder / "plan.json")))
    assert "ONNX" in str(err.value) and "export-onnx --plan" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_plan_must_match_the_onnx_file(onnx_plan, tmp_path):
    plan, _ = onnx_plan
    other = build_model("gpt-tiny", batch=1, seq=SEQ, device="cpu")  # another batch: another graph
    path = export_onnx(other.module, other.example_inputs, tmp_path / "other.onnx")
    moved = dataclasses.replace(plan, model=dataclasses.replace(plan.model, spec=str(path)))
    with pytest.raises(PlanMismatchError, match="not the model the plan was made from"):
        export_stages(moved, tmp_path / "stages")
    assert not (tmp_path / "stages").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.onnx", "other.onnx.data"]  # nothing staged left


def test_output_folder_checks_and_replacing_an_earlier_export(onnx_plan, tmp_path):
    plan, folder = onnx_plan
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidInputError, match="is a file"):
        check_output_folder(tmp_path / "file")
    with pytest.raises(InvalidInputError, match="not a folder"):
        check_output_folder(tmp_path / "file" / "stages")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="holds other files"):
        export_stages(plan, tmp_path / "other", plan_path=folder / "plan.json")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    export_stages(plan, tmp_path / "empty", plan_path=folder / "plan.json")
    (tmp_path / "empty" / "stage9.onnx").write_text("stale")
    export_stages(plan, tmp_path / "empty", plan_path=folder / "plan.json")  # an earlier export is replaced
    assert not (tmp_path / "empty" / "stage9.onnx").exists() and (tmp_path / "empty" / MANIFEST).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "other"]
