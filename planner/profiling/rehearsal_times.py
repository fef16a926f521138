"""Time a plan's stage passes and checks here as its rehearsal runs them: the local prices behind ``stagewise
run``'s "predicted step here" (``planner.rehearsal.LocalTimes``).

The profile times one preset's blocks at one shape in float32, back to back. A rehearsal's ranks run the
plan's own stage graphs (exported, split) in its compute dtype, each pass after waiting for a message, its
caches cold (on the 2-core VM gpt-tiny's first stage forward takes 0.51 ms after a 30 ms wait and 0.06 ms back
to back), and its verifiers score the boundary tensors those stages produce. So this builds every stage as
the runtime does, runs each forward and backward after a short sleep and keeps the median CPU time of each,
and times each verifier's check on the tensors the stages passed on, each stage's optimizer step (the
profile prices Adam as memory passes; a CPU's per-tensor kernels cost more for small stages: gpt-tiny's
middle stage steps in 1.6 ms here against 0.95 priced), and the verifiers' end-of-step blame.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from models.registry import build_model
from planner.integrity.hooks import VerifyHooks
from planner.plan import Plan
from planner.rehearsal import (
    LocalTimes,
    Rehearsal,
    as_rehearsed,
    local_device_type,
    predict_rehearsal,
    rehearsal_dtype,
    timeable,
)
from planner.runtime.data import make_source, parse_data_spec, resolve_loss
from planner.runtime.rank.apply import plan_node_names
from planner.runtime.rank.precision import Precision
from planner.runtime.rank.rank_setup import make_optimizer
from planner.runtime.rank.recompute import build_plan_stage
from planner.runtime.rank.stage import split_graph
from planner.simulate import without_verification

GAP_S = 0.005  # a rank waits for its next message between passes: its caches go cold meanwhile
REPEATS = 8    # timed runs of each pass after one that warms up (their median: a pass of a small model is noisy)
SLOW_STEP_S = 0.5  # a first step slower than this: skip the verifiers' warm-up and time 2 steps (seconds, not minutes)


def predict_here(plan: Plan, profile: str | Path, *, emulate: bool, slowdown: float = 1.0, busy_now: float = 0.0,
                 dtype: str = "auto", backend: str = "auto", data: str = "auto", clip: bool = False,
                 accumulate: int = 1, verify: bool = True, cores: int | None = None) -> Rehearsal:
    """``stagewise run``'s prediction here (``planner.rehearsal.predict_rehearsal``), its stages and checks
    timed first where its ranks compute on this CPU (a few seconds for a small model); ``verify``: False for
    a run with ``--no-verify``."""
    plan = plan if verify else without_verification(plan)
    device = local_device_type(backend)
    local = None
    if device == "cpu":
        if parse_data_spec(data).kind == "factory":
            data = "auto"  # the checks cost the same on any data: this process imports no one's factory
        local = rehearsal_times(as_rehearsed(plan, dtype, device), rehearsal_dtype(plan, dtype, device), data=data)
    return predict_rehearsal(plan, profile, emulate=emulate, slowdown=slowdown, busy_now=busy_now, dtype=dtype,
                             local=local, clip=clip, accumulate=accumulate, cores=cores)


def rehearsal_times(plan: Plan, dtype: str, *, data: str = "auto", repeats: int = REPEATS,
                    gap_s: float = GAP_S) -> LocalTimes | None:
    """Per stage the median CPU ms of a forward and of a backward of one microbatch in ``dtype`` (one thread,
    as every rank), per checked (boundary, direction) the verifier's check and the step's blame, on the run's
    ``data`` (its labels feed the checks); None for a model this process may not time
    (``planner.rehearsal.timeable``)."""
    if not timeable(plan):
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _timed(plan, Precision.of(dtype), data=data, repeats=repeats, gap_s=gap_s)
    finally:
        torch.set_num_threads(threads)


def _timed(plan: Plan, precision: Precision, *, data: str, repeats: int, gap_s: float) -> LocalTimes:
    """One process runs the plan's steps as its ranks would, in order: every stage's forward, the checks of
    the activations, every backward, the checks of the gradients, the verifiers' blame; each pass and check
    after a gap. The steps before the verifiers' warm-up ends are not timed."""
    ref = plan.model
    bundle = build_model(ref.spec, batch=plan.config.microbatch_size, seq=ref.seq, device="cpu", seed=0)
    split = split_graph(bundle.module, bundle.example_inputs, plan_node_names(plan))
    stages = [build_plan_stage(split, plan, k, bundle.module, device="cpu") for k in range(plan.num_stages)]
    optimizers = [make_optimizer(plan.config.optimizer, [p for _, p in stage.parameters()], lr=None)
                  for stage in stages]
    source = make_source(bundle, kind=data, seq=ref.seq, seed=0)
    loss_fn = resolve_loss(bundle)
    checks = _Checks(plan, data=data)
    warm = any(len(info.microbatches) > 1 for info in plan.ranks)
    warmup = plan.verifier_config.warmup + 1 if checks.hooks else 1  # checks grow dearer once references are learnt
    times: dict[tuple[str, int | str], list[float]] = {}
    step = 0
    while step < warmup + repeats:
        started = time.perf_counter()
        record = (lambda key, ms: times.setdefault(key, []).append(ms)) if step >= warmup else (lambda key, ms: None)
        _one_step(stages, optimizers, checks, source.batch(step, plan.config.microbatch_size), step, record,
                  precision=precision, loss_fn=loss_fn, gap_s=gap_s, warm=warm)
        if step == 0 and time.perf_counter() - started > SLOW_STEP_S:  # a larger model: time it briefly
            warmup, repeats = 1, min(repeats, 2)
        step += 1
    med = {key: statistics.median(ms) for key, ms in times.items()}
    return LocalTimes(fwd_ms=tuple(med[("F", k)] for k in range(len(stages))),
                      bwd_ms=tuple(med[("B", k)] for k in range(len(stages))),
                      optim_ms=tuple(med.get(("optim", k), 0.0) for k in range(len(stages))),
                      fwd_warm_ms=tuple(med[("F warm", k)] for k in range(len(stages))) if warm else (),
                      bwd_warm_ms=tuple(med[("B warm", k)] for k in range(len(stages))) if warm else (),
                      check_ms=tuple((b, d, med[(d, f"check {b}")]) for b, d in sorted(checks.pairs)
                                     if (d, f"check {b}") in med),
                      blame_ms=med.get(("blame", "end"), 0.0))


def _one_step(stages, optimizers, checks: _Checks, batch, step: int, record, *, precision: Precision,
              loss_fn: Callable, gap_s: float, warm: bool) -> None:
    """Every stage's forward and its activations' checks, every backward and its gradients' checks, every
    stage's optimizer step, then the verifiers' blame, each recorded by ``record(key, ms)``; ``warm``: each
    pass also run again at once (``"F warm"``, ``"B warm"``)."""
    inputs, targets = batch
    values, saved, warm_saved = list(inputs), [], {}
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        held, roots, ms = _forward(stage, values, precision, gap_s=gap_s, loss=loss_fn if last else None,
                                   targets=targets)
        record(("F", k), ms)
        saved.append((held, roots))
        if warm:   # the same pass again at once: a rank's later microbatches find their caches warm
            again = _forward(stage, values, precision, gap_s=0.0, loss=loss_fn if last else None, targets=targets)
            record(("F warm", k), again[2])
            warm_saved[k] = again[:2]
        if not last:
            checks.run(k, "F", roots, step, record, gap_s)
            values = [o.detach() for o in roots]
    grads: list[torch.Tensor] = []
    for k in reversed(range(len(stages))):
        held, roots = saved[k]
        seeds = None if k == len(stages) - 1 else grads
        record(("B", k), _backward(roots, seeds, gap_s=gap_s))
        if warm:
            record(("B warm", k), _backward(warm_saved[k][1], seeds, gap_s=0.0))
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in held]
        if k:
            checks.run(k - 1, "B", grads, step, record, gap_s)
    for k, optimizer in enumerate(optimizers):
        record(("optim", k), _optimizer_step(optimizer, gap_s=gap_s))
        stages[k].module.zero_grad(set_to_none=True)
    checks.end(step, record)


def _optimizer_step(optimizer: torch.optim.Optimizer | None, *, gap_s: float) -> float:
    """CPU ms of one step of a stage's optimizer (0 for a stage without parameters)."""
    if optimizer is None:
        return 0.0
    time.sleep(gap_s)
    start = time.thread_time()
    optimizer.step()
    return 1e3 * (time.thread_time() - start)


def _forward(stage, values: Sequence[torch.Tensor], precision: Precision, *, gap_s: float, loss: Callable | None,
             targets: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """The stage's forward as a rank runs it (the ``loss`` of its output and ``targets`` on the last stage):
    its inputs that carry gradients, what its backward starts from (its outputs as sent, or the loss), and its
    CPU ms."""
    time.sleep(gap_s)
    inputs = [t.detach().requires_grad_(spec.carries_grad and t.is_floating_point())
              for t, spec in zip(values, stage.inputs)]
    start = time.thread_time()
    args = [t.to(spec.dtype) if t.is_floating_point() else t for t, spec in zip(inputs, stage.inputs)]
    with torch.enable_grad(), precision.autocast(torch.device("cpu")):
        outputs = tuple(stage.module(*args))
        if loss is not None:
            roots = [loss(outputs[0] if len(outputs) == 1 else outputs, targets)]
        else:
            roots = list(precision.to_wire(outputs))
    ms = 1e3 * (time.thread_time() - start)
    held = [t for t, spec in zip(inputs, stage.inputs) if spec.carries_grad and t.is_floating_point()]
    return held, roots, ms


def _backward(roots: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor] | None, *, gap_s: float) -> float:
    """CPU ms of the backward from ``roots`` (the loss, or the outputs with ``seeds``, their gradients)."""
    time.sleep(gap_s)
    start = time.thread_time()
    pairs = [(r, g) for r, g in zip(roots, seeds or [None] * len(roots)) if r.requires_grad]
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], None if seeds is None else [g for _, g in pairs])
    return 1e3 * (time.thread_time() - start)


class _Checks:
    """The plan's verifiers, each checking its boundaries as the runtime's ``VerifyHooks`` do."""

    def __init__(self, plan: Plan, *, data: str) -> None:
        self.plan = plan
        self.hooks = {r: h for r in sorted({v.rank for v in plan.verifiers})
                      if (h := VerifyHooks(plan, r, seed=0, data=data)).verifier is not None}
        self.by_pair = {(v.boundary, "F" if d == "act" else "B"): v.rank for v in plan.verifiers for d in v.directions}
        self.pairs = set(self.by_pair)

    def run(self, boundary: int, d: str, tensors: Sequence[torch.Tensor], step: int, record, gap_s: float) -> None:
        rank = self.by_pair.get((boundary, d))
        if rank not in self.hooks or not tensors:
            return
        sender = self.plan.owner(boundary if d == "F" else boundary + 1, 0)
        time.sleep(gap_s)
        start = time.thread_time()
        self.hooks[rank].check(boundary, d, [t.detach() for t in tensors], step=step, mb=0, sender=sender,
                               tainted=False)
        record((d, f"check {boundary}"), 1e3 * (time.thread_time() - start))

    def end(self, step: int, record) -> None:
        """Every verifier's flags and blame: the dearest is what the step waits for."""
        costs = []
        for hooks in self.hooks.values():
            start = time.thread_time()
            hooks.end_step(step, [hooks.step_flags(step)])
            costs.append(1e3 * (time.thread_time() - start))
        if costs:
            record(("blame", "end"), max(costs))
