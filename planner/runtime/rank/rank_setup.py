"""What a rank builds to run its part of a plan: its checked stage, its subgroups, its optimizer.

The model is rebuilt from ``plan.model.spec`` and its fingerprint checked
against a fresh export before the process group is joined (``prepare_rank``).
Each rank builds the model on the meta device and materialises only its own
stage's parameters (``models`` initialise weights by name, so they equal the
unpipelined model's); models without that ability are built whole on the CPU.
An ``hf:DIR`` model then reads its stage's tensors from the folder's weights
(``models.hf_weights``), unless ``--init random`` or a resumed run (whose checkpoint wins).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from models.hf_tokens import model_folder
from models.hf_weights import WeightFiles, check_weights, find_weights, load_weights
from models.registry import build_model
from planner.errors import InvalidInputError
from planner.runtime.data import PlanBatches, make_source, resolve_loss
from planner.runtime.options import LR_SCHEDULES, RunOptions, check_model_allowed
from planner.runtime.rank.recompute import build_plan_stage
from planner.runtime.rank.stage import (
    EdgeSpecs,
    SplitGraph,
    StageRuntime,
    check_fingerprint,
    export_model,
    has_constants,
    materialize,
    plan_node_names,
    split_graph,
    stage_edges,
    stage_state_names,
)
from planner.runtime.wire import comm, control
from planner.runtime.wire.comm import Groups


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEnv:
    """This process's place in the launcher's world (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls, *, own_store: bool = False) -> "RankEnv":
        """``own_store``: started without a launcher (``--store``): only ``LOCAL_RANK`` (default 0) is set."""
        if own_store:
            return cls(rank=0, world_size=0, local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0))
        try:
            return cls(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        except (KeyError, ValueError) as exc:
            raise InvalidInputError("rank environment", expected="RANK and WORLD_SIZE set (by torchrun or "
                                    "`stagewise run`)", found=f"missing or bad {exc}",
                                    fix="start ranks with `stagewise run` or torchrun") from None


@dataclass(slots=True)
class RankSetup:
    """Everything a rank builds before joining the process group."""

    split: SplitGraph
    stage: StageRuntime | None
    edges: dict[int, EdgeSpecs]
    batches: PlanBatches | None
    loss_fn: Any
    device: torch.device


def rank_device(opts: RunOptions, env: RankEnv) -> torch.device:
    if opts.backend == "nccl" or (opts.backend == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def check_model(plan, *, seed: int = 0, model: str | None = None):
    """Rebuild the plan's model on the meta device, export it and compare fingerprints.

    Returns ``(bundle, exported program)``; raises PlanMismatchError if the
    model the spec builds today is not the one the plan was made for.
    """

    ref = plan.model
    check_model_allowed(ref.spec, model)
    bundle = build_model(ref.spec, batch=ref.batch, seq=ref.seq, device="meta", seed=seed)
    ep = export_model(bundle.module, bundle.example_inputs)
    check_fingerprint(ep, plan)
    return bundle, ep


def pretrained_weights(spec: str, opts: RunOptions) -> WeightFiles | None:
    """The saved weights a run starts from: an ``hf:DIR`` folder's, unless ``--init random``, or a resumed run
    (it loads its checkpoint instead, so reading the folder's would be wasted)."""
    if opts.init != "pretrained" or opts.resume:
        return None
    folder = model_folder(spec)
    return find_weights(folder) if folder is not None else None


def check_pretrained(plan, opts: RunOptions, model: torch.nn.Module) -> bool:
    """Before any rank starts: the folder's weights hold every parameter of the plan's ``model`` (built on
    meta is enough: headers only are read) at its shape. True when the run starts from saved weights."""
    weights = pretrained_weights(plan.model.spec, opts)
    if weights is None:
        return False
    check_weights(model, weights, what=f"--init pretrained for {plan.model.spec}")
    return True


def prepare_rank(plan, rank: int, opts: RunOptions, device: torch.device) -> RankSetup:
    """Rebuild the model, check the fingerprint, split it and build this rank's stage."""

    ref = plan.model
    bundle, ep = check_model(plan, seed=opts.seed, model=opts.model)
    mbs = plan.config.microbatch_size
    if mbs != ref.batch:  # traced at another batch: export again at the microbatch shape
        bundle = build_model(ref.spec, batch=mbs, seq=ref.seq, device="meta", seed=opts.seed)
        ep = export_model(bundle.module, bundle.example_inputs)
    split = split_graph(bundle.module, bundle.example_inputs, plan_node_names(plan), ep=ep)
    edges = {b: EdgeSpecs(act=tuple(split.specs[n] for n in stage_edges(split, b + 1)[0]))
             for b in range(plan.num_stages - 1)}
    info = plan.ranks[rank]
    if info.stage is None:
        return RankSetup(split=split, stage=None, edges=edges, batches=None, loss_fn=None, device=device)
    model = bundle.module
    # Presets initialise by parameter name, so a rank can materialise its own stage only and still hold
    # exactly the weights of `build_model(spec, device="cpu", seed=seed)`. A factory's weights come from
    # running it under the seed, so those ranks build the whole model.
    if bundle.preset is not None and callable(getattr(model, "init_weights", None)) and not has_constants(split):
        materialize(model, stage_state_names(split, info.stage), device)
        model.init_weights(opts.seed)
    else:
        model = build_model(ref.spec, batch=mbs, seq=ref.seq, device=str(device), seed=opts.seed).module
        if has_constants(split):
            split = split_graph(model, tuple(t.to(device) for t in bundle.example_inputs), plan_node_names(plan))
    weights = pretrained_weights(ref.spec, opts)
    if weights is not None:
        load_weights(model, weights, stage_state_names(split, info.stage), what=f"--init pretrained for {ref.spec}")
    stage = build_plan_stage(split, plan, info.stage, model, device=device)
    batches = loss = None
    if stage.is_first or stage.is_last:
        source = make_source(bundle, kind=opts.data, seq=ref.seq, seed=opts.seed)
        batches = PlanBatches(source, global_batch=plan.config.global_batch, microbatch_size=mbs, device=device)
        loss = resolve_loss(bundle, opts.loss) if stage.is_last else None
    return RankSetup(split=split, stage=stage, edges=edges, batches=batches, loss_fn=loss, device=device)


def make_groups(plan, split: SplitGraph, rank: int, timeout_s: float) -> Groups:
    """Create every subgroup on every rank in one order: replicated stages, verifiers, tied parameters, then
    (NCCL) the channels'."""
    stage_sets = [plan.stage_ranks(k) for k in range(plan.num_stages)]
    verifier_ranks = tuple(sorted({v.rank for v in plan.verifiers}))
    users: dict[str, set[int]] = {}
    for k in range(plan.num_stages):
        for name in stage_state_names(split, k):
            users.setdefault(name, set()).add(k)
    tied: dict[tuple[int, ...], list[str]] = {}
    params = {target for kind, target in split.state.values() if kind == "param"}
    for name, stages in sorted(users.items()):
        if len(stages) > 1 and name in params:  # a tied parameter: its stages sum its gradient
            ranks = tuple(sorted(r for k in stages for r in plan.stage_ranks(k)))
            tied.setdefault(ranks, []).append(name)
    tied_sets = sorted(tied)
    made = comm.new_groups([*stage_sets, verifier_ranks, *tied_sets], timeout_s=timeout_s)
    # NCCL pairs a pair's messages by posting order alone: a communicator per channel (none under gloo)
    comm.open_channels(comm.run_channels(plan.num_stages - 1, control.Topic), timeout_s=timeout_s)
    info = plan.ranks[rank]
    groups = Groups()
    if info.stage is not None:
        groups.stage, groups.stage_ranks = made[info.stage], stage_sets[info.stage]
    groups.verifiers, groups.verifier_ranks = made[len(stage_sets)], verifier_ranks
    for ranks, group in zip(tied_sets, made[len(stage_sets) + 1:]):
        if group is not None:
            groups.tied.append((group, ranks, tuple(tied[ranks])))
    return groups


DEFAULT_LR: dict[str, float] = {"sgd": 0.01, "adam": 1e-3, "adamw": 1e-3}
OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def make_optimizer(name: str, params: Sequence[torch.nn.Parameter], *, lr: float | None,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer | None:
    """SGD, Adam or AdamW over this rank's parameters (the plan's ``config.optimizer``; lr default per
    DEFAULT_LR). ``weight_decay`` is each class's own: decoupled in AdamW, an L2 term in Adam and SGD."""
    params = list(params)
    if not params:
        return None
    if name not in OPTIMIZER_CLASSES:
        raise InvalidInputError("optimizer", expected=", ".join(OPTIMIZER_CLASSES), found=repr(name))
    rate = DEFAULT_LR[name] if lr is None else lr
    return OPTIMIZER_CLASSES[name](params, lr=rate, weight_decay=weight_decay)


def lr_factor(step: int, *, warmup: int, schedule: str, total_steps: int) -> float:
    """The learning rate of ``step`` (from 0) over --lr: ``(step + 1) / warmup`` during the warm-up, then
    constant 1, or linear or cosine from 1 at the warm-up's end to 0 at ``total_steps``. Closed form, so a
    resumed run gets its step's rate by counting steps."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    done = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if schedule == "linear":
        return 1.0 - done
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * done))
    raise InvalidInputError("--lr-schedule", expected="constant, linear or cosine", found=repr(schedule))


def make_lr_schedule(optimizer: torch.optim.Optimizer | None, *, warmup: int, schedule: str = "constant",
                     total_steps: int = 0, first_step: int = 0) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The run's learning-rate schedule (see :func:`lr_factor`) from ``first_step`` (a resumed run's first),
    stepped once after each optimizer step. None: the rate never changes (no optimizer, or no warm-up and
    a constant schedule)."""
    if schedule not in LR_SCHEDULES:
        raise InvalidInputError("--lr-schedule", expected=", ".join(LR_SCHEDULES), found=repr(schedule))
    if optimizer is None or (warmup <= 0 and schedule == "constant"):
        return None
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(first_step + k, warmup=warmup, schedule=schedule, total_steps=total_steps))


def make_lr_warmup(optimizer: torch.optim.Optimizer | None,
                   steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A linear learning-rate warm-up: step ``k`` (from 0) trains at ``lr * min(1, (k + 1) / steps)``, as
    most recipes start, since full-rate Adam steps on a fresh model can spike the loss. None: no warm-up."""
    return make_lr_schedule(optimizer, warmup=steps)
