"""``stagewise export-onnx --plan PLAN -o DIR`` end to end: stage files and manifest written; a bad -o, a
factory plan without --model and ``run`` on an ONNX plan are one line on stderr and exit 2, with no partial DIR."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

from models.registry import build_model
from planner.api import plan_chain
from planner.model_io import load_chain
from planner.onnx_import import export_onnx

CLUSTER = Path(__file__).resolve().parents[2] / "cost_models" / "clusters" / "box-8gpu.yaml"


def _one_clean_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """mlp-tiny as ONNX, planned as 2 stages; the plan names the file relative to its own folder."""
    folder = tmp_path_factory.mktemp("planned")
    bundle = build_model("mlp-tiny", batch=4, device="cpu")
    model = export_onnx(bundle.module, bundle.example_inputs, folder / "mlp.onnx")
    _, chain = load_chain(str(model))
    plan_chain(chain, CLUSTER, spec="mlp.onnx", stages=2, global_batch=8, time_limit_s=5).save(folder / "plan.json")
    inputs = {"x": bundle.example_inputs[0].numpy()}
    return folder, ReferenceEvaluator(str(model)).run(None, inputs)[0], inputs


def test_export_onnx_plan_writes_one_file_per_stage_and_a_manifest(run_cli, planned, tmp_path):
    folder, whole, inputs = planned
    out = tmp_path / "nested" / "stages"
    proc = run_cli("export-onnx", "--plan", str(folder / "plan.json"), "-o", str(out))  # the model beside the plan
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "stages.json").read_text())
    assert [s["file"] for s in manifest["stages"]] == ["stage0.onnx", "stage1.onnx"]
    assert all((out / s["file"]).is_file() for s in manifest["stages"])
    assert "stage1.onnx" in proc.stdout
    values = {manifest["inputs"][0]["name"]: next(iter(inputs.values()))}
    for stage in manifest["stages"]:
        outs = ReferenceEvaluator(str(out / stage["file"])).run(None, {t["name"]: values[t["name"]]
                                                                       for t in stage["inputs"]})
        values.update(zip((t["name"] for t in stage["outputs"]), outs))
    np.testing.assert_allclose(values[manifest["outputs"][0]["name"]], whole, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nested"]  # nothing staged left behind


def _bad_output(kind: str, d: Path) -> Path:
    """An -o that cannot take the stage files: an .onnx name, a path under a file, a foreign folder."""
    if kind == "onnx-name":
        return d / "stages.onnx"
    (d / "taken").mkdir()
    (d / "taken" / "notes.txt").write_text("x")
    return d / "taken" / "notes.txt" / "stages" if kind == "under-file" else d / "taken"


@pytest.mark.parametrize("kind, needle", [
    ("onnx-name", "a folder for the stage files"), ("under-file", "not a folder"),
    ("foreign-folder", "holds other files"),
])
def test_a_bad_output_folder_is_one_line_and_leaves_nothing(cli_here, planned, tmp_path, kind, needle):
    folder, _, _ = planned
    out = _bad_output(kind, tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    line = _one_clean_error_line(cli_here("export-onnx", "--plan", str(folder / "plan.json"), "-o", str(out)))
    assert needle in line
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # no partial DIR


def test_shapes_do_not_go_with_a_plan(run_cli, planned, tmp_path):
    folder, _, _ = planned
    line = _one_clean_error_line(run_cli("export-onnx", "--plan", str(folder / "plan.json"), "-o",
                                         str(tmp_path / "s"), "--batch", "8"))
    assert "--batch" in line and "the plan fixes it" in line
    assert not (tmp_path / "s").exists()


def test_a_factory_plan_needs_model_before_anything_is_imported(run_cli, planned, tmp_path):
    folder, _, _ = planned
    data = json.loads((folder / "plan.json").read_text())
    data["model"]["spec"] = "tests.fixtures.model_factories:mlp_only"
    data.pop("signature", None)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    line = _one_clean_error_line(run_cli("export-onnx", "--plan", str(tmp_path / "plan.json"),
                                         "-o", str(tmp_path / "s")))
    assert "--model tests.fixtures.model_factories:mlp_only" in line
    assert not (tmp_path / "s").exists()


def test_run_on_an_onnx_plan_says_what_to_do_instead(run_cli, planned):
    folder, _, _ = planned
    line = _one_clean_error_line(run_cli("run", str(folder / "plan.json"), "--steps", "1"))
    assert "ONNX" in line and "export-onnx --plan" in line
