"""`stagewise plan` on a model whose layers draw random numbers (dropout): the stage they land on, on an untrusted
device, is not audited, and the plan says why."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Trusted T4s at the ends, an untrusted H100 takes the middle: the stage an audit would check.
CLUSTER = """
name: watched
hosts:
  - {name: dc, region: dc, trust: op, trusted: true, devices: [{type: T4, count: 2}]}
  - {name: v0, region: home, trust: v0, devices: [{type: H100-80GB}]}
  - {name: checker, region: dc, trust: op, trusted: true, role: verifier}
links:
  default: {bandwidth_gbps: 100, latency_ms: 0.1}
"""


def test_a_stage_with_dropout_is_not_audited_and_the_plan_says_why(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "c.yaml").write_text(CLUSTER)
    model = "hf:gpt2?n_layer=2,n_embd=128,n_head=2,vocab_size=256,n_positions=32"
    res = subprocess.run([sys.executable, "-m", "planner", "plan", model, "--cluster", "c.yaml", "--stages", "3",
                          "--dtype", "fp32", "--time-limit", "2", "-o", "plan.json"], cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    middle = doc["stages"][1]
    assert {"dropout", "scaled_dot_product_attention"} <= {op for b in middle["blocks"] for op in b["random_ops"]}
    assert middle["audit_every"] == 0
    text = " ".join(res.stdout.split())   # the console may wrap a long note
    assert re.search(r"stage 1: its replica not audited: it draws random numbers \([^)]*dropout", text), text
