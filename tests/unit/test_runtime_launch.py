"""Run options, fault specs and failure diagnosis of the local launcher (planner.runtime.launcher.launch)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from planner.errors import InvalidInputError
from planner.runtime.launcher.launch import _Rank, diagnose, root_cause
from planner.runtime.options import FaultSpec, RunOptions
from planner.runtime.run_args import parse_worker_args


def test_worker_argv_round_trips_every_option():
    opts = RunOptions(plan="p.json", steps=7, timeout_s=12.5, emulate=True, emulate_slowdown=2.5,
                      metrics="m.jsonl", report="r.json",
                      attacks=("rank=1,kind=zeros", "rank=2,kind=noise"), verify=False, seed=3, data="synthetic",
                      loss="a.b:c", lr=0.5, lr_warmup=20, dump="d", fault=FaultSpec(rank=1, kind="hang", step=2),
                      threads=2, backend="gloo", host="h0")
    assert parse_worker_args(opts.worker_argv()) == opts
    assert parse_worker_args(["p.json"]) == RunOptions(plan="p.json")


def test_no_worker_flag_is_claimed_by_torchrun():
    """torchrun parses flags after the module too: none of ours may equal or prefix one of its options."""
    from torch.distributed.run import get_args_parser

    theirs = [o for a in get_args_parser()._actions for o in a.option_strings if o.startswith("--")]
    ours = [o for o in RunOptions(plan="p", emulate=True, emulate_slowdown=2.0, verify=False, metrics="m",
                                  report="r", loss="a:b",
                                  lr=1.0, lr_warmup=3, dump="d", fault=FaultSpec(rank=0, kind="die"),
                                  attacks=("x",), host="h").worker_argv() if o.startswith("--")]
    clashes = [(o, t) for o in ours for t in theirs if t.startswith(o)]
    assert not clashes


@pytest.mark.parametrize("text", ["1", "x:die", "1:explode", "1:die:x", "-1:die"])
def test_bad_fault_specs_are_refused(text):
    with pytest.raises(InvalidInputError):
        FaultSpec.parse(text)


@pytest.mark.parametrize("bad", [dict(emulate_slowdown=0.5, emulate=True), dict(emulate_slowdown=2.0),
                                 dict(steps=0), dict(timeout_s=0), dict(threads=0), dict(backend="mpi"),
                                 dict(lr=-1.0), dict(lr_warmup=-1)])
def test_bad_options_are_refused(bad):
    with pytest.raises(InvalidInputError):
        RunOptions(plan="p.json", **bad)


def test_lr_warmup_raises_the_rate_linearly_then_holds_it():
    import torch

    from planner.runtime.rank.rank_setup import make_lr_warmup

    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.4)
    warmup = make_lr_warmup(opt, 4)
    rates = []
    for _ in range(6):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        warmup.step()
    assert rates == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert make_lr_warmup(opt, 0) is None and make_lr_warmup(None, 4) is None


def _rank(tmp_path, r, code, *, killed=False, log=""):
    path = tmp_path / f"rank{r}.log"
    path.write_text(log)
    return _Rank(rank=r, proc=SimpleNamespace(returncode=code), log_path=path, killed=killed)


def _record(tmp_path, r, kind, error, peer):
    (tmp_path / f"rank{r}.json").write_text(json.dumps({"rank": r, "kind": kind, "error": error, "peer": peer}))


def test_diagnosis_names_a_dead_rank_over_those_that_lost_it(tmp_path):
    ranks = [_rank(tmp_path, 0, 3), _rank(tmp_path, 1, -9), _rank(tmp_path, 2, 3)]
    _record(tmp_path, 0, "RankFailureError", "rank 1 died", 1)
    _record(tmp_path, 2, "RankFailureError", "rank 1 died", 1)
    line = diagnose(ranks, tmp_path, 10)
    assert line.startswith("rank 1 died (was killed by signal 9)") and "[0, 2]" in line


def test_diagnosis_names_a_hung_rank_and_an_exception(tmp_path):
    ranks = [_rank(tmp_path, 0, 3), _rank(tmp_path, 1, -9, killed=True)]
    _record(tmp_path, 0, "RankFailureError", "rank 1 did not answer", 1)
    assert diagnose(ranks, tmp_path, 7).startswith("rank 1 hung (no progress within the 7 s timeout")
    crash = [_rank(tmp_path, 0, 1, log="Traceback\n[rank0]: ValueError: boom\n"), _rank(tmp_path, 1, 3)]
    (tmp_path / "rank0.json").unlink()
    assert diagnose(crash, tmp_path, 7).startswith("rank 0 failed: ValueError: boom")


def test_verifier_warmup_covers_the_lr_warmup():
    """While the learning rate climbs the boundary statistics move with it: the monitors' honest warm-up
    lasts at least as long (and the plan's own, when longer)."""
    from planner.integrity.hooks import monitor_config
    from planner.verifier_config import VerifierConfig

    plan = SimpleNamespace(verifier_config=VerifierConfig(warmup=5))
    assert monitor_config(plan, 0)["warmup"] == 5
    assert monitor_config(plan, 0, lr_warmup=20)["warmup"] == 20
    assert monitor_config(plan, 0, lr_warmup=3)["warmup"] == 5


def test_diagnosis_blames_the_sender_of_a_malformed_message_not_its_reader(tmp_path):
    """Rank 0 read a malformed message from rank 2 and stopped; rank 1 then lost rank 0. The sender is the
    root cause (a re-plan excludes its host), even though it exited cleanly."""
    ranks = [_rank(tmp_path, 0, 3), _rank(tmp_path, 1, 3), _rank(tmp_path, 2, 0)]
    _record(tmp_path, 0, "ProtocolError", "rank 2 sent a malformed flags; expected UTF-8 JSON", 2)
    _record(tmp_path, 1, "RankFailureError", "rank 0 died", 0)
    root, line = root_cause(ranks, tmp_path, 10)
    assert root == 2 and line.startswith("rank 2 broke the protocol (rank 2 sent a malformed flags)")
