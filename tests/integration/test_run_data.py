"""`stagewise run --data tokens:FILE.bin --save-weights OUT`: the user's token ids train the pipeline and
the weights come out in the model's own layout, equal to a single-process run on the same tokens; a bad
data file or output path is one line and exit 2 before any rank starts, with no file written."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_model

import planner.runtime.data as data
from models.registry import build_model
from tests.dist.plans import make_plan, reference_run
from tests.integration.test_cli_run import _one_line_error

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
STEPS = 2


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", "run", *args], capture_output=True, text=True,
                          env=ENV, timeout=300)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)], optimizer="adam")


@pytest.fixture(scope="module")
def plan_path(plan, tmp_path_factory):
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def test_token_file_trains_and_the_saved_weights_equal_a_single_process_run(plan, plan_path, tmp_path,
                                                                            monkeypatch):
    tokens = tmp_path / "train.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 256, size=5000, dtype=np.uint16).astype("<u2").tofile(tokens)
    out = tmp_path / "out.safetensors"
    proc = cli(str(plan_path), "--steps", str(STEPS), "--timeout", "60", "--data", f"tokens:{tokens}",
               "--save-weights", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"trained weights written to {out}" in " ".join(proc.stdout.split())
    # The reference draws its batches from the same file (reference_run takes the default source).
    monkeypatch.setattr(data, "make_source", functools.partial(data.make_source, kind=f"tokens:{tokens}"))
    _, _, params = reference_run(plan, steps=STEPS)
    model = build_model("gpt-tiny", batch=2, seq=16, device="cpu", seed=9).module
    load_model(model, out, strict=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", ["odd bin", "id >= vocab", "folder out"])
def test_bad_data_or_output_is_one_line_and_writes_nothing(plan_path, tmp_path, case):
    out = tmp_path / "out.safetensors"
    spec = "auto"
    if case == "odd bin":
        (tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 100 + b"\x07")
        spec, says = f"tokens:{tmp_path / 'odd.bin'}", "odd byte count"
    elif case == "id >= vocab":
        np.save(tmp_path / "big.npy", np.arange(300))
        spec, says = f"tokens:{tmp_path / 'big.npy'}", "token ids in [0, 256)"
    else:
        out.mkdir()
        says = "--save-weights"
    line = _one_line_error(cli(str(plan_path), "--steps", "1", "--data", spec, "--save-weights", str(out)))
    assert says in line, line
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors" and p.is_file()] == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no hidden checkpoint left
