"""A rank's side of checkpoints: the step a resumed run starts at, and what each rank writes every
``checkpoint_every`` steps (with the ranks' vote on stopping after it, which the local launcher asks for)."""
from __future__ import annotations

import os
from typing import Any

import torch

from planner.integrity.hooks import VerifyHooks
from planner.runtime import checkpoint, comm
from planner.runtime.executor import Executor
from planner.runtime.options import RunOptions
from planner.runtime.rank_setup import RankEnv
from planner.runtime.stage import StageRuntime


def rank_layout(plan) -> list[list[Any]]:
    """Who each rank is (host, device, stage): ban evidence is per rank, so it only carries over a resume
    onto the same layout (a re-planned run numbers its ranks afresh)."""
    return [[r.host, r.device, r.stage] for r in plan.ranks]


def resume_step(plan, opts: RunOptions, env: RankEnv, stage: StageRuntime | None,
                optimizer: torch.optim.Optimizer | None, verify: VerifyHooks | None, executor: Executor) -> int:
    """The first step to run: 0, or with ``--resume`` the one after the newest complete checkpoint
    (a verifier rank gets its ban evidence back: killing a rank to force a restart wipes no bans)."""
    if not opts.resume:
        return 0
    step = checkpoint.latest(opts.checkpoint_dir, fingerprint=plan.model.fingerprint)
    params = dict(stage.parameters()) if stage is not None else {}
    got = checkpoint.restore_rank(opts.checkpoint_dir, step=step, params=params, optimizer=optimizer,
                                  rank=env.rank)
    same_layout = got.state.get("layout", rank_layout(plan)) == rank_layout(plan)
    if verify is not None and verify.verifier is not None and "bans" in got.state and same_layout:
        verify.verifier.restore_bans(got.state["bans"])
    if executor.scaler is not None and "loss_scale" in got.state:
        executor.scaler.restore(got.state["loss_scale"])
    executor.untrained_steps = [int(s) for s in got.state.get("untrained_steps", [])]
    return step + 1


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
                    step: int) -> bool:
    """Every ``checkpoint_every`` steps and after the last: each rank writes its file, rank 0 the manifest
    (and, while a verifier's flag is unresolved, keeps the last checkpoint before it). True when the ranks
    agreed to stop after it: the local launcher asked for that (``STOP_ENV``'s file exists) when one rank
    reached the checkpoint; the agreement is the sum that replaces a barrier, so every rank decides alike."""
    if opts.checkpoint_dir is None or ((step + 1) % opts.checkpoint_every and step != opts.steps - 1):
        return False
    params = dict(stage.parameters()) if stage is not None else {}
    checkpoint.save_rank(opts.checkpoint_dir, step=step, rank=env.rank, fingerprint=plan.model.fingerprint,
                         params=params, optimizer=optimizer, state=rank_state(plan, verify, executor))
    asked = os.environ.get(STOP_ENV)
    votes = torch.tensor([1.0 if asked and os.path.exists(asked) else 0.0], device=executor.device)
    comm.all_reduce_sum(votes, group=None, ranks=range(env.world_size),
                        doing=f"writing the checkpoint of step {step}")  # every rank has written its file
    if env.rank == 0:
        checkpoint.complete(opts.checkpoint_dir, step=step, num_ranks=env.world_size,
                            fingerprint=plan.model.fingerprint,
                            keep_before=min(executor.unresolved.values(), default=None))
    return bool(votes.item() > 0)
