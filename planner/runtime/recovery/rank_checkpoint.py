"""A rank's side of checkpoints: the step a resumed run starts at, and what each rank writes every
``checkpoint_every`` steps (with the control rank's decision on stopping after it, which the local launcher
asks for)."""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

from planner.errors import CheckpointError, ProtocolError
from planner.integrity.hooks import VerifyHooks
from planner.runtime.options import RunOptions
from planner.runtime.rank.executor import Executor
from planner.runtime.rank.rank_setup import RankEnv, make_lr_schedule
from planner.runtime.rank.stage import StageRuntime
from planner.runtime.recovery import checkpoint, retention
from planner.runtime.recovery.forgery import Forgery
from planner.runtime.wire import control
from planner.secret import run_secret


def rank_layout(plan) -> list[list[Any]]:
    """Who each rank is (host, device, stage): ban evidence is per rank, so it only carries over a resume
    onto the same layout (a re-planned run numbers its ranks afresh)."""
    return [[r.host, r.device, r.stage] for r in plan.ranks]


def resume_step(plan, opts: RunOptions, env: RankEnv, stage: StageRuntime | None,
                optimizer: torch.optim.Optimizer | None, verify: VerifyHooks | None, executor: Executor) -> int:
    """The first step to run: 0, or with ``--resume`` the one after the newest good checkpoint, which the
    control rank chooses for all (a verifier rank gets its ban evidence back: killing a rank to force a
    restart wipes no bans). A rank file that no longer matches its manifest is blamed on its writer."""
    if not opts.resume:
        return 0
    key = run_secret(opts.secret_file)
    step = _agreed_resume_step(plan, opts, env, executor.device, key)
    params = dict(stage.parameters()) if stage is not None else {}
    try:
        got = checkpoint.restore_rank(opts.checkpoint_dir, step=step, params=params, optimizer=optimizer,
                                      rank=env.rank, key=key)
    except CheckpointError as exc:
        if exc.writer is None:
            raise
        raise ProtocolError(str(exc), sender=exc.writer) from None
    same_layout = got.state.get("layout", rank_layout(plan)) == rank_layout(plan)
    if verify is not None and verify.verifier is not None and "bans" in got.state and same_layout:
        verify.verifier.restore_bans(got.state["bans"])
    if executor.scaler is not None and "loss_scale" in got.state:
        executor.scaler.restore(got.state["loss_scale"])
    executor.untrained_steps = [int(s) for s in got.state.get("untrained_steps", [])]
    return step + 1


def resume_copies(opts: RunOptions, env: RankEnv, executor: Executor, first: int) -> None:
    """An auditor's copies of audited stages at the checkpoint a resumed run starts after (``first`` - 1): the
    replicas' parameters and optimizer state, and the learning-rate schedule from ``first``; a fresh copy would
    fail every honest replica's audit."""
    audits = getattr(executor, "audits", None)
    if not opts.resume or audits is None or not audits.copies:
        return
    key = run_secret(opts.secret_file)
    for copy in audits.copies.values():
        checkpoint.restore_rank(opts.checkpoint_dir, step=first - 1, params=dict(copy.runtime.parameters()),
                                optimizer=copy.optimizer, rank=env.rank, key=key)
        copy.schedule = make_lr_schedule(copy.optimizer, warmup=opts.lr_warmup, schedule=opts.lr_schedule,
                                         total_steps=opts.steps, first_step=first)


def _agreed_resume_step(plan, opts: RunOptions, env: RankEnv, device: torch.device, key: bytes) -> int:
    """The control rank checks the checkpoints (signatures, every file's hash), says which newer ones it
    refused and why, and sends every rank the step to resume from."""
    ctl = control.CONTROL_RANK
    chosen = None
    if env.rank == ctl:
        found = checkpoint.latest(opts.checkpoint_dir, fingerprint=plan.model.fingerprint, key=key)
        for line in found.refused:
            print(f"stagewise run: checkpoint refused, {line}", file=sys.stderr, flush=True)
        if found.refused:
            print(f"stagewise run: resuming from the checkpoint of step {found.step}", file=sys.stderr, flush=True)
        chosen = torch.tensor([found.step], dtype=torch.int64, device=device)
    got = control.send_from(chosen, src=ctl, me=env.rank, ranks=range(env.world_size), topic=control.Topic.RESUME,
                            shape=(1,), dtype=torch.int64, device=device, doing="agreeing on the checkpoint to resume")
    return int(got.item())


def rank_state(plan, verify: VerifyHooks | None, executor: Executor) -> dict[str, Any]:
    """What a checkpoint keeps of a rank beside its tensors (a survivor's file too)."""
    state: dict[str, Any] = {"layout": rank_layout(plan), "untrained_steps": list(executor.untrained_steps)}
    if verify is not None and verify.verifier is not None:
        state["bans"] = verify.verifier.bans_state()
    if executor.scaler is not None:
        state["loss_scale"] = executor.scaler.state()
    return state


STOP_ENV = "STAGEWISE_STOP_FILE"  # set by the local launcher: the file whose presence asks the ranks to stop


def save_checkpoint(plan, opts: RunOptions, env: RankEnv, stage: StageRuntime | None,
                    optimizer: torch.optim.Optimizer | None, verify: VerifyHooks | None, executor: Executor,
                    step: int, forge: Forgery | None = None) -> bool:
    """Every ``checkpoint_every`` steps and after the last: each rank writes its file and sends its sha256
    to the control rank, which writes the signed manifest and prunes older ones by the run's audit lookback
    (``retention``: the checkpoints a ban's recovery may resume from stay). True when the ranks are to stop after it: the control rank
    decides for all (the local launcher asked for that, ``STOP_ENV``'s file exists) and tells each rank."""
    if opts.checkpoint_dir is None or ((step + 1) % opts.checkpoint_every and step != opts.steps - 1):
        return False
    params = dict(stage.parameters()) if stage is not None else {}
    digest = checkpoint.save_rank(opts.checkpoint_dir, step=step, rank=env.rank, fingerprint=plan.model.fingerprint,
                                  params=forge.planted(plan, params) if forge else params, optimizer=optimizer,
                                  state=rank_state(plan, verify, executor))
    ctl, everyone, device = control.CONTROL_RANK, range(env.world_size), executor.device
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8).to(device)
    got = control.gather_to(mine, dst=ctl, me=env.rank, ranks=everyone, topic=control.Topic.CHECKPOINT,
                            device=device, doing=f"writing the checkpoint of step {step}")
    stop = None
    if got is not None:  # every rank has written its file
        checkpoint.complete(opts.checkpoint_dir, step=step, layout=checkpoint.Layout.of(plan),
                            key=run_secret(opts.secret_file), digests={r: bytes(t.cpu().numpy()).hex()
                                                                       for r, t in got.items()},
                            unresolved=executor.unresolved, lookback=retention.run_lookback(plan, opts))
        asked = os.environ.get(STOP_ENV)
        stop = torch.tensor([int(bool(asked and os.path.exists(asked)))], dtype=torch.int64, device=device)
    stop = control.send_from(stop, src=ctl, me=env.rank, ranks=everyone, topic=control.Topic.CHECKPOINT, shape=(1,),
                             dtype=torch.int64, device=device, doing=f"completing the checkpoint of step {step}")
    if forge is not None:
        forge.swap(opts.checkpoint_dir, step, plan.model.fingerprint, params)
    return bool(stop.item())
