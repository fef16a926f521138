"""Bad input to any command: one line on stderr naming what is wrong, exit 2, before any long work starts (the
command's main in this process: ``cli_here``).

The plan path of the ``run`` and ``replan`` cases does not exist: each option must be refused before the
plan is even read, so the line names the option, not the missing file.
"""
from __future__ import annotations

import importlib.util

import pytest

HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
MISSING_PLAN = "no-such-plan.json"

CASES = {
    "hf-layers-not-a-number": (("trace", "hf:gpt2?n_layer=abc"), "n_layer", HF),
    "hf-zero-layers": (("trace", "hf:gpt2?n_layer=0"), "n_layer=0", HF),
    "hf-negative-layers": (("trace", "hf:gpt2?n_layer=-1"), "n_layer=-1", HF),
    "plan-time-limit-nan": (("plan", "gpt-tiny", "--time-limit", "nan"), "--time-limit", None),
    "plan-time-limit-inf": (("plan", "gpt-tiny", "--time-limit", "inf"), "--time-limit", None),
    "plan-time-limit-negative": (("plan", "gpt-tiny", "--time-limit", "-1"), "--time-limit", None),
    "plan-workers-zero": (("plan", "gpt-tiny", "--workers", "0"), "--workers", None),
    "replan-workers-negative": (("replan", MISSING_PLAN, "--exclude", "h", "-o", "new.json", "--workers", "-1"),
                                "--workers", None),
    "replan-time-limit-nan": (("replan", MISSING_PLAN, "--exclude", "h", "-o", "new.json", "--time-limit", "nan"),
                              "--time-limit", None),
    "run-fault-not-a-rank": (("run", MISSING_PLAN, "--fault", "x:die"), "--fault", None),
    "run-lr-nan": (("run", MISSING_PLAN, "--lr", "nan"), "--lr", None),
    "run-timeout-nan": (("run", MISSING_PLAN, "--timeout", "nan"), "--timeout", None),
    "plan-output-in-proc": (("plan", "gpt-tiny", "-o", "/proc/x/plan.json"), "/proc/x/plan.json", None),
    # 10**12 samples: the microbatch counts tried are bounded (at most 8192 a step), so this ends at once
    # with the memory it would need, instead of pricing programs of 10**12 microbatches for minutes.
    "plan-huge-global-batch": (("plan", "gpt-tiny", "--global-batch", str(10**12), "--time-limit", "5"),
                               "needs", None),
}


PARAMS = [pytest.param(argv, says, id=name, marks=() if mark is None else (mark,))
          for name, (argv, says, mark) in CASES.items()]


@pytest.mark.parametrize(("argv", "says"), PARAMS)
def test_bad_input_is_one_line_and_exit_2(cli_here, tmp_path, argv, says):
    output = ("-o", "plan.json") if argv[0] == "plan" and "-o" not in argv else ()
    res = cli_here(*argv, *output, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert len(lines) == 1, res.stderr
    assert says in lines[0]
    assert not (tmp_path / "plan.json").exists()  # nothing half-written
