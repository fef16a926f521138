"""No prefix or spelling of a plan's model spec imports anything the operator did not name with --model.

Every prefix the registry knows (``hf:``, the API's ``python:`` label, a factory's ``module:``, the
``.onnx`` suffix, the --data prefixes) and odd spellings are tried on the commands that build a plan's
model; a module of each name waits in the working folder (first on the import path, as under
``python -m``) and leaves a marker if imported. None may be.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import hf
from models.registry import API_PREFIX, build_model, is_data_spec, spec_kind
from planner.cli import main
from planner.errors import InvalidInputError
from planner.runtime.options import check_model_allowed
from tests.dist.plans import make_plan

MODULES = ("evil", "python", "EVIL", "Python", "HF", "text", "tokens", "file", "preset", "pkg/__init__",  # not onnx: the library
           "pkg/mod")
PREFIXES = (hf.PREFIX, API_PREFIX, "text:", "tokens:", "onnx:", "file:", "preset:", "evil:", "")
ODD = ("python:evil", " evil:factory", "evil:factory", "EVIL:FACTORY", "evil:factory ", "pkg.mod:fn ", "Python:evil",
       "HF:evil", "hf :evil", "\tevil:factory", "evil:factory\n", "evil:factory:x", ":factory", "evil:", "./evil:factory",
       "evil", "gpt-tiny ", "GPT-TINY", "evil:factory.onnx", "python:evil.onnx", "pkg.mod:fn", "pkg/mod:fn")
SPECS = tuple(dict.fromkeys((*ODD, *(f"{p}evil" for p in PREFIXES), *(f"{p}evil:factory" for p in PREFIXES))))
CODE_CONFIG = {"model_type": "gpt2", "n_layer": 1, "auto_map": {"AutoModelForCausalLM": "evil--modeling.Evil"}}


def _trap(root: Path) -> Path:
    """Modules named like every spec's module part, each writing ``markers/<name>`` when imported."""
    markers = root / "markers"
    markers.mkdir()
    for name in MODULES:
        path = root / f"{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"import pathlib\npathlib.Path({str(markers / name.replace('/', '.'))!r}).write_text('x')\n"
                        "def factory():\n    raise RuntimeError('imported')\nfn = evil = factory\n")
    evil = root.parent / "evil"  # hf:../evil: a model folder whose config asks for its own code
    evil.mkdir(exist_ok=True)
    (evil / "config.json").write_text(json.dumps(CODE_CONFIG))
    (evil / "modeling.py").write_text(f"import pathlib\npathlib.Path({str(markers / 'modeling')!r}).write_text('x')\n")
    return markers


@pytest.fixture()
def trap(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    markers = _trap(work)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    before = set(sys.modules)
    yield work, markers
    leaked = {m.split(".")[0] for m in set(sys.modules) - before} & {n.split("/")[0] for n in MODULES}
    assert not leaked, leaked
    assert not list(markers.iterdir())


def test_every_prefix_is_classified_by_one_allowlist():
    assert {spec_kind(f"{p}evil") for p in PREFIXES} == {"hf", "api", "factory", "preset"}
    assert [s for s in SPECS if is_data_spec(s) and spec_kind(s) not in ("hf", "onnx")] == []
    assert spec_kind("python:evil") == "api" and not is_data_spec("python:evil")


@pytest.mark.parametrize("spec", SPECS)
def test_no_spec_from_a_plan_imports_without_the_operators_word(trap, spec):
    others = {None, "evil:factory", "pkg.mod:fn", spec.strip()} - {spec}
    for named in others:
        if is_data_spec(spec) and spec_kind(spec) != "onnx":
            check_model_allowed(spec, named)  # data: no --model needed
        else:
            with pytest.raises(InvalidInputError):
                check_model_allowed(spec, named)
    if is_data_spec(spec) or spec_kind(spec) in ("api", "onnx"):  # past the gate, or a label: built from data only
        with pytest.raises(InvalidInputError):
            build_model(spec)


def test_an_hf_folder_cannot_name_its_own_code(trap):
    for spec in ("hf:../evil", "hf:../evil/config.json", "hf:gpt2?trust_remote_code=true,n_layer=1",
                 "hf:gpt2?auto_map=evil,n_layer=1"):
        pytest.importorskip("transformers")
        with pytest.raises(InvalidInputError, match="custom code"):
            build_model(spec)


def _signed_plan(folder: Path, spec: str) -> Path:
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, spec=spec))
    return plan.save(folder / f"plan{abs(hash(spec))}.json")


def test_run_and_export_refuse_every_spec_in_one_line(trap, capsys):
    work, _ = trap
    refused = [s for s in SPECS if not is_data_spec(s) or spec_kind(s) == "onnx"]
    assert len(refused) > 30
    for spec in refused:
        path = str(_signed_plan(work, spec))
        for argv in (["run", path, "--steps", "1"], ["run", path, "--model", "other.mod:factory"],
                     ["export-onnx", "--plan", path, "-o", str(work / "out")]):
            assert main(argv) == 2, (spec, argv)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err, (spec, argv, err)


def test_the_reported_attack_end_to_end(tmp_path):
    """A re-signed plan naming ``python:evil`` beside a python.py: `stagewise run` exits 2, one line, nothing
    imported (ranks would start with the working folder first on their path)."""
    markers = _trap(tmp_path)
    path = _signed_plan(tmp_path, "python:evil")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "planner", "run", path.name, "--steps", "1"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "python:evil" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(markers.iterdir())
