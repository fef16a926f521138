"""What the CLI shows: the sequence length (trace, plan, show, the plan file), encoder-decoders refused by name,
a bad ``--rehearse-dtype`` in one line, whole tables and no third-party progress bars outside a terminal."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

GPT2 = "hf:gpt2?n_layer=2,n_embd=32,n_head=2,n_positions=16,vocab_size=64"


def _one_clean_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def _piped(*args: str) -> subprocess.CompletedProcess:
    """The CLI with stdout a pipe and no COLUMNS set (as in CI logs and `| tee`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_sequence_length_is_shown_and_recorded(cli_here, tmp_path):
    """In this process (``cli_here``): what is tested is what the commands print and record, not their processes
    (four torch+transformers start-ups were ~20 of its 29 s)."""
    pytest.importorskip("transformers")
    run_cli = cli_here
    proc = run_cli("trace", GPT2)
    assert proc.returncode == 0, proc.stderr
    assert "seq 16" in proc.stdout
    assert json.loads(run_cli("trace", GPT2, "--json").stdout)["graph"]["seq"] == 16
    plan = tmp_path / "plan.json"
    proc = run_cli("plan", GPT2, "--stages", "2", "--dtype", "fp32", "--time-limit", "5", "-o", str(plan))
    assert proc.returncode == 0, proc.stderr
    assert "seq 16" in proc.stdout
    assert json.loads(plan.read_text())["model"]["seq"] == 16  # was null: the traced length, not the flag
    proc = run_cli("show", str(plan), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "seq 16" in proc.stdout.splitlines()[0] + proc.stdout.splitlines()[1]


def test_an_encoder_decoder_is_refused_by_name_with_what_is_supported(cli_here, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64,
                                   architectures=["T5ForConditionalGeneration"])
    config.save_pretrained(tmp_path / "t5")
    for spec in (f"hf:{tmp_path / 't5'}", "hf:t5?num_layers=1"):
        line = _one_clean_error_line(cli_here("trace", spec))  # main, in this process
        assert "T5ForConditionalGeneration (encoder-decoder) is not supported" in line
        assert "gpt2, llama" in line and "bert" in line and "factory" not in line


def test_a_bad_rehearse_dtype_is_one_line(cli_here, tmp_path):
    line = _one_clean_error_line(cli_here("run", str(tmp_path / "plan.json"), "--rehearse-dtype", "fp8"))
    assert "--rehearse-dtype" in line and "plan" in line


def test_tables_are_whole_outside_a_terminal(tmp_path):
    proc = _piped("plan", "gpt-tiny", "--stages", "3", "--time-limit", "5", "-o", str(tmp_path / "tiny.json"))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert rows and all("(A100-80GB)" in row or "(RTX3090)" in row for row in rows), proc.stdout  # no row wrapped
    assert max(len(line) for line in proc.stdout.splitlines()) > 80


def test_transformers_progress_bars_are_off_outside_a_terminal(tmp_path):
    pytest.importorskip("transformers")
    code = ("from planner.outputs import plain_output; plain_output(); import transformers; "
            "print(transformers.utils.logging.is_progress_bar_enabled())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          check=False, env={"PATH": "", "PYTHONPATH": str(REPO_ROOT), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
