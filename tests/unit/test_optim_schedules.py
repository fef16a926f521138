"""The run's optimizers and learning-rate schedules (``rank_setup``), their options, AdamW's memory price and
the clipping exchange's checks (``executor_optim``)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cost_models.memory import bytes_per_param
from cost_models.training import TrainingConfig
from planner.errors import InvalidInputError, ProtocolError
from planner.runtime.options import RunOptions
from planner.runtime.run_args import parse_worker_args
from planner.runtime.rank.executor_optim import GradientSteps
from planner.runtime.rank.rank_setup import lr_factor, make_lr_schedule, make_optimizer
from planner.runtime.wire import control
from planner.runtime.wire.comm import Groups


def _rates(schedule, steps: int, *, start: int = 0) -> list[float]:
    """The rate of each step from ``start`` on, as a worker resumed at ``start`` sets them."""
    opt = make_optimizer("adamw", [torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_lr_schedule(opt, total_steps=steps, first_step=start, **schedule)
    out = []
    for _ in range(start, steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradient: no update, but torch wants the optimizer stepped before its scheduler
        sched.step()
    return out


def test_warmup_then_cosine_and_linear_reach_zero_at_the_last_step():
    cosine = _rates({"warmup": 2, "schedule": "cosine"}, 6)
    assert cosine == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                    0.5 * (1 + math.cos(3 * math.pi / 4))])
    assert _rates({"warmup": 0, "schedule": "linear"}, 4) == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert _rates({"warmup": 3, "schedule": "constant"}, 4) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert lr_factor(10, warmup=2, schedule="cosine", total_steps=6) == pytest.approx(0.0)  # past --steps: 0


def test_a_resumed_schedule_continues_where_it_stopped():
    schedule = {"warmup": 2, "schedule": "cosine"}
    assert _rates(schedule, 7, start=3) == pytest.approx(_rates(schedule, 7)[3:])


def test_no_schedule_without_warmup_or_decay_and_unknown_schedule_refused():
    opt = make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert make_lr_schedule(opt, warmup=0, schedule="constant", total_steps=5) is None
    assert make_lr_schedule(None, warmup=2, schedule="cosine", total_steps=5) is None
    with pytest.raises(InvalidInputError, match="--lr-schedule"):
        make_lr_schedule(opt, warmup=2, schedule="step", total_steps=5)


def test_adamw_takes_the_weight_decay_and_unknown_optimizers_are_refused():
    opt = make_optimizer("adamw", [torch.nn.Parameter(torch.zeros(1))], lr=None, weight_decay=0.05)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["weight_decay"] == 0.05 and opt.param_groups[0]["lr"] == 1e-3
    with pytest.raises(InvalidInputError, match="optimizer"):
        make_optimizer("lion", [torch.nn.Parameter(torch.zeros(1))], lr=None)


def test_adamw_state_is_priced_as_adams():
    for dtype, mixed in (("float32", False), ("bfloat16", True), ("bfloat16", False)):
        adam, adamw = (bytes_per_param(TrainingConfig(global_batch=4, microbatch_size=2, optimizer=o, dtype=dtype,
                                                      mixed_precision=mixed)) for o in ("adam", "adamw"))
        assert adamw == adam


def test_options_round_trip_through_the_worker_command_line():
    opts = RunOptions(plan="p.json", lr_schedule="linear", weight_decay=0.01, clip_grad=1.5, lr_warmup=3)
    assert parse_worker_args(opts.worker_argv()) == opts
    assert parse_worker_args(RunOptions(plan="p.json").worker_argv()) == RunOptions(plan="p.json")


@pytest.mark.parametrize(("field", "value"), [("weight_decay", -1.0), ("weight_decay", math.inf),
                                              ("clip_grad", 0.0), ("clip_grad", math.nan), ("lr_schedule", "exp")])
def test_bad_options_are_refused_by_name(field, value):
    with pytest.raises(InvalidInputError, match="--" + field.replace("_", "-")):
        RunOptions(plan="p.json", **{field: value})


class _Clipper(GradientSteps):
    """The executor's clipping alone: ``rank`` of a plan of ``num_ranks``, holding ``params`` by name."""

    def __init__(self, rank: int, num_ranks: int, params: dict[str, torch.nn.Parameter], *,
                 stage_ranks: tuple[int, ...] = (), tied: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...] = ()):
        self.rank, self.clip_grad, self.device = rank, 1.0, torch.device("cpu")
        self.plan = SimpleNamespace(num_ranks=num_ranks)
        self.stage = SimpleNamespace(parameters=lambda: list(params.items()))
        self.params = list(params.values())
        self.groups = Groups(stage_ranks=stage_ranks, tied=[(None, ranks, names) for ranks, names in tied])


def _param(*values: float) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    return p


def _square_norm(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float64)


def test_each_parameter_counts_once_on_the_lowest_rank_holding_it():
    params = {"own": _param(1.0), "tied": _param(2.0)}
    second_replica = _Clipper(2, 4, params, stage_ranks=(1, 2))
    first_replica = _Clipper(1, 4, params, stage_ranks=(1, 2), tied=(((0, 1, 2), ("tied",)),))
    assert second_replica._norm_params() == []
    assert first_replica._norm_params() == [params["own"]]  # the tied one counts on rank 0
    assert _Clipper(0, 4, params, stage_ranks=(0,), tied=(((0, 1, 2), ("tied",)),))._norm_params() == \
        list(params.values())


def test_the_control_rank_sums_the_squared_norms_and_clips_everyone(monkeypatch):
    sent = {}
    monkeypatch.setattr(control, "gather_to", lambda value, **kw: {0: value, 1: _square_norm(12.0)})
    monkeypatch.setattr(control, "send_from", lambda value, **kw: sent.setdefault("total", value))
    params = {"w": _param(2.0)}  # 4 here + 12 from rank 1: global norm 4, scale 1 / (4 + 1e-6)
    _Clipper(0, 2, params, stage_ranks=(0,))._clip()
    assert float(sent["total"]) == 16.0
    torch.testing.assert_close(params["w"].grad, torch.tensor([2.0 / (4.0 + 1e-6)]))


def test_a_negative_squared_norm_is_a_protocol_error_naming_its_sender(monkeypatch):
    monkeypatch.setattr(control, "gather_to", lambda value, **kw: {0: value, 1: _square_norm(-1.0)})
    with pytest.raises(ProtocolError, match="rank 1 sent an impossible squared gradient norm") as info:
        _Clipper(0, 2, {"w": _param(1.0)}, stage_ranks=(0,))._clip()
    assert info.value.peer == 1


@pytest.mark.parametrize("diverged", [math.nan, math.inf])
def test_a_diverged_norm_blames_nobody_and_clips_nothing(monkeypatch, diverged):
    monkeypatch.setattr(control, "gather_to", lambda value, **kw: {0: value, 1: _square_norm(diverged)})
    monkeypatch.setattr(control, "send_from", lambda value, **kw: value)
    params = {"w": _param(3.0)}
    _Clipper(0, 2, params, stage_ranks=(0,))._clip()
    assert params["w"].grad.tolist() == [3.0]
