"""What a local rehearsal computes in (``planner.rehearsal``): a float16 plan runs as bfloat16 on a CPU unless
``--rehearse-dtype`` says otherwise, and says so; the prediction names what it cannot price."""
from __future__ import annotations

import dataclasses

import pytest

from planner.errors import InvalidInputError
from planner.plan_load import load_plan
from planner.rehearsal import (
    as_rehearsed,
    predict_rehearsal,
    profile_warnings,
    rehearsal_dtype,
    rehearsal_note,
)
from planner.runtime.options import RunOptions
from planner.runtime.run_args import parse_worker_args
from tests.unit.test_rehearsal import GOLDEN, PROFILE


@pytest.fixture(scope="module")
def fp16_plan():
    plan = load_plan(GOLDEN)
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, dtype="float16", mixed_precision=True))


@pytest.mark.parametrize(("requested", "device", "expected"), [
    ("auto", "cpu", "bfloat16"), ("auto", "cuda", "float16"), ("plan", "cpu", "float16"),
    ("fp32", "cpu", "float32"), ("bf16", "cuda", "bfloat16"), ("fp16", "cpu", "float16")])
def test_a_float16_plan_rehearses_in_bfloat16_on_a_cpu_unless_asked(fp16_plan, requested, device, expected):
    assert rehearsal_dtype(fp16_plan, requested, device) == expected
    rehearsed = as_rehearsed(fp16_plan, requested, device)
    assert rehearsed.config.dtype == expected
    assert rehearsed.config.mixed_precision == (expected != "float32")
    assert (rehearsed is fp16_plan) == (expected == "float16")


def test_the_switch_is_said_in_one_line(fp16_plan):
    note = rehearsal_note(fp16_plan, "auto", "cpu")
    assert note is not None and "\n" not in note
    assert "bfloat16" in note and "float16" in note and "--rehearse-dtype plan" in note
    assert rehearsal_note(fp16_plan, "plan", "cpu") is None
    assert rehearsal_note(load_plan(GOLDEN), "auto", "cpu") is None  # float32 stays float32


def test_an_unknown_dtype_is_refused(fp16_plan):
    with pytest.raises(InvalidInputError, match="--rehearse-dtype"):
        rehearsal_dtype(fp16_plan, "fp8", "cpu")
    with pytest.raises(InvalidInputError, match="--rehearse-dtype"):
        RunOptions(plan="p.json", rehearse_dtype="fp8")


def test_the_ranks_get_the_choice_on_their_command_line():
    opts = RunOptions(plan="p.json", rehearse_dtype="plan")
    assert parse_worker_args(opts.worker_argv()).rehearse_dtype == "plan"
    assert "--rehearse-dtype" not in RunOptions(plan="p.json").worker_argv()


def test_a_model_not_timed_here_is_named_in_the_prediction(fp16_plan):
    here = predict_rehearsal(fp16_plan, PROFILE, emulate=True)  # a factory: never imported from a plan
    assert here.dtype == "bfloat16" and here.pass_scale is None
    assert any("priced at the profile's bfloat16 matmul peak" in w for w in here.warnings)


def test_a_profile_timed_on_several_threads_is_named():
    got = profile_warnings({"host": {"device": "cpu", "torch_threads": 2}})
    assert len(got) == 1 and "2 torch threads" in got[0] and "--threads 1" in got[0]
    assert profile_warnings({"host": {"device": "cpu", "torch_threads": 1}}) == ()
