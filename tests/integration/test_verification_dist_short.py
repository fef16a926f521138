"""The short version of benchmarks/verification_dist.py: a clean `stagewise run` of the replicated gpt-tiny plan
(4 gloo ranks, 10 steps) bans nobody, and its row in the JSON is well-formed."""
from __future__ import annotations

import json

from benchmarks.verification_dist import main

STEPS = 10
MICROBATCHES = 16


def test_a_short_clean_run_of_the_replicated_plan_bans_nobody(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--shapes", "replicated", "--seeds", "0", "--steps", str(STEPS), "--attacks", "none",
                 "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    [row] = data["rows"]
    assert "error" not in row, row
    assert (row["shape"], row["seed"], row["attack"], row["exit_code"]) == ("replicated", 0, "none", 0)
    assert row["steps_run"] == STEPS and row["banned"] == [] and row["bans"] == []
    # one verifier checks boundary 0's gradients and boundary 1's activations; its other two monitors watch
    assert row["checks"] == STEPS * MICROBATCHES * 2
    assert row["fpr_per_sample"] == round(row["flags_microbatch"] / row["checks"], 6)
    assert row["dropped"] >= 0 and row["flags_step"] >= 0 and isinstance(row["final_loss"], float)
    assert data["summary"]["clean_runs"] == 1 and data["summary"]["clean_runs_with_bans"] == []
    assert "replicated" in capsys.readouterr().out
