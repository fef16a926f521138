"""The control plane against a hostile worker (``planner.runtime.recovery.forgery``): rank 1, a volunteer's
untrusted rank, forges verdicts, its run summary, its error record and its checkpoint files. Each
forgery is ignored (the honest ranks end with an unforged run's parameters), refused, or stops the run
naming rank 1; never does it ban, un-ban or poison anyone else."""
from __future__ import annotations

import pytest
import torch

from planner.errors import InvalidInputError
from planner.runtime.launcher.launch import RunBanned, RunFailure, launch
from planner.runtime.options import RunOptions
from planner.runtime.recovery.forgery import ENV_VAR
from planner.verifier_config import VerifierConfig
from tests.dist.plans import load_dumps, make_plan

torch.set_num_threads(1)
STEPS = 4


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """mlp-tiny on 3 stages (rank 1 on the untrusted host h1), a CPU verifier rank 3."""
    tmp = tmp_path_factory.mktemp("forgery")
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=4, stages=[(0, 1), (2, 3), (4, 5)],
                     verifiers=[(0, 3, ("act", "grad")), (1, 3, ("act", "grad"))], verifier_host=True,
                     verifier_config=VerifierConfig(warmup=2, ban_false_steps=100), untrusted=(1,))
    assert not plan.effective_cluster().device(plan.ranks[1].device).trusted
    path = plan.save(tmp / "plan.json")
    launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp / "clean")))
    return plan, path, _params(tmp / "clean", plan.num_ranks)


def _params(folder, num_ranks) -> dict[str, torch.Tensor]:
    return {n: t for d in load_dumps(folder, num_ranks) for n, t in d["params"].items()}


def test_forged_verdicts_frame_nobody_and_the_honest_ranks_train_as_without_them(verified, tmp_path, monkeypatch):
    plan, path, clean = verified
    monkeypatch.setenv(ENV_VAR, "rank=1,kinds=verdict")
    launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp_path / "dump")))
    got = _params(tmp_path / "dump", plan.num_ranks)
    assert got.keys() == clean.keys()
    for name in clean:
        torch.testing.assert_close(got[name], clean[name], rtol=0, atol=0)


def test_an_attacker_cannot_cancel_its_own_ban_or_pass_it_to_a_trusted_rank(verified, monkeypatch):
    _, path, _ = verified
    monkeypatch.setenv(ENV_VAR, "rank=1,kinds=verdict+record")
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=8, timeout_s=60,
                          attacks=("rank=1,kind=scale,factor=inf,start=2,dir=act",)))
    assert [n.rank for n in stopped.value.notices] == [1] and stopped.value.hosts == {1: "h1"}
    assert stopped.value.result["banned"] == [1]


def test_a_summary_claiming_a_ban_stops_the_run_naming_its_sender(verified, monkeypatch):
    _, path, _ = verified
    monkeypatch.setenv(ENV_VAR, "rank=1,kinds=summary")
    with pytest.raises(RunFailure) as failed:
        launch(RunOptions(plan=str(path), steps=2, timeout_s=60))
    assert failed.value.rank == 1 and "rank 1 reported bans" in str(failed.value)


def test_planted_parameters_in_a_volunteers_checkpoint_are_never_restored(verified, tmp_path, monkeypatch):
    plan, path, clean = verified
    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setenv(ENV_VAR, "rank=1,kinds=plant")
    launch(RunOptions(plan=str(path), steps=STEPS - 2, timeout_s=60, checkpoint_dir=ckpt, checkpoint_every=1))
    monkeypatch.delenv(ENV_VAR)
    launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, checkpoint_dir=ckpt, checkpoint_every=1,
                      resume=True, dump=str(tmp_path / "dump")))
    got = _params(tmp_path / "dump", plan.num_ranks)
    for name in clean:
        torch.testing.assert_close(got[name], clean[name])


def test_a_checkpoint_file_swapped_after_its_manifest_is_refused_and_blamed_on_its_writer(verified, tmp_path,
                                                                                          monkeypatch):
    _, path, _ = verified
    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setenv(ENV_VAR, "rank=1,kinds=swap")
    launch(RunOptions(plan=str(path), steps=2, timeout_s=60, checkpoint_dir=ckpt, checkpoint_every=1))
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(InvalidInputError) as refused:
        launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, checkpoint_dir=ckpt, resume=True))
    assert "rank 1's file" in str(refused.value) and "host h1" in str(refused.value)
