"""Bad optimizer and schedule options: one line on stderr naming the option, exit 2, before the plan is read
(its path does not exist, so the line names the option, not the missing file); the command's main in this
process (``cli_here``)."""
from __future__ import annotations

import pytest

MISSING_PLAN = "no-such-plan.json"

CASES = {
    "weight-decay-negative": (("run", MISSING_PLAN, "--weight-decay", "-0.1"), "--weight-decay"),
    "weight-decay-nan": (("run", MISSING_PLAN, "--weight-decay", "nan"), "--weight-decay"),
    "lr-schedule-unknown": (("run", MISSING_PLAN, "--lr-schedule", "step"), "--lr-schedule"),
    "clip-grad-zero": (("run", MISSING_PLAN, "--clip-grad", "0"), "--clip-grad"),
    "clip-grad-negative": (("run", MISSING_PLAN, "--clip-grad", "-1"), "--clip-grad"),
    "clip-grad-nan": (("run", MISSING_PLAN, "--clip-grad", "nan"), "--clip-grad"),
    "clip-grad-inf": (("run", MISSING_PLAN, "--clip-grad", "inf"), "--clip-grad"),
    "plan-optimizer-unknown": (("plan", "gpt-tiny", "--optimizer", "lion", "-o", "plan.json"), "--optimizer"),
}


@pytest.mark.parametrize(("argv", "says"), list(CASES.values()), ids=list(CASES))
def test_bad_optimizer_option_is_one_line_and_exit_2(cli_here, tmp_path, argv, says):
    res = cli_here(*argv, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert len(lines) == 1, res.stderr
    assert says in lines[0]
    assert not (tmp_path / "plan.json").exists()
