"""`stagewise run --eval-data/--eval-every`, `--tensorboard` and `--accumulate` from the command line: the
validation loss in the output, the report and the metrics file (beside each step's training loss), a
TensorBoard event file, and one-line errors (exit 2) for their bad inputs (the command's main in this process)."""
from __future__ import annotations

import json

import pytest

from tests.dist.plans import make_plan
from tests.integration.test_cli_run import _one_line_error, cli


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def test_validation_loss_reaches_output_report_metrics_and_tensorboard(plan_path, tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    metrics, report, board = tmp_path / "m.jsonl", tmp_path / "r.json", tmp_path / "tb"
    proc = cli(str(plan_path), "--steps", "3", "--timeout", "60", "--eval-data", "synthetic", "--eval-every", "2",
               "--metrics", str(metrics), "--report", str(report), "--tensorboard", str(board), "--accumulate", "2")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert [e["step"] for e in data["eval_losses"]] == [1, 2] and data["accumulate"] == 2
    assert "validation loss (after step 3)" in proc.stdout and f"{data['final_eval_loss']:.4f}" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["loss"] for r in rows if r["rank"] == 0] == pytest.approx(data["losses"], rel=1e-5)
    assert sorted({r["step"] for r in rows if "eval_loss" in r}) == [1, 2]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(board))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "eval/loss", "train/lr", "time/step_ms"}
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 3]
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(data["final_eval_loss"], rel=1e-5)


BAD = {
    "eval-every-zero": (("--eval-data", "synthetic", "--eval-every", "0"), "--eval-every"),
    "eval-every-without-data": (("--eval-every", "2"), "--eval-data"),
    "accumulate-zero": (("--accumulate", "0"), "--accumulate"),
    "eval-data-unknown": (("--eval-data", "nonsense"), "data source 'nonsense'"),
    "eval-data-missing-file": (("--eval-data", "tokens:no-such.npy"), "no-such.npy"),
}


@pytest.mark.parametrize(("flags", "says"), list(BAD.values()), ids=list(BAD))
def test_bad_eval_or_accumulate_option_is_one_line_exit_2(cli_here, plan_path, tmp_path, flags, says):
    line = _one_line_error(cli_here("run", str(plan_path), "--steps", "2", *flags, "--report",
                                    str(tmp_path / "r.json")))
    assert says in line
    assert not (tmp_path / "r.json").exists()


def test_accumulate_on_a_verified_plan_is_refused_in_one_line(cli_here, tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)],
                     verifiers=[(0, 2, ("act",))], verifier_host=True)
    path = plan.save(tmp_path / "plan.json")
    line = _one_line_error(cli_here("run", str(path), "--steps", "2", "--accumulate", "2"))
    assert "--accumulate 2 with verification on" in line and "--no-verify" in line
