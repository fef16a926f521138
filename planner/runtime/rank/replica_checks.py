"""Replicas check each other in the runtime (issue 37): the gradient contributions of an untrusted stage's
replicas, seen by the lead verifier, and an optional Byzantine-robust sum of them.

* Before its stage's all-reduce, every replica of a *watched* stage (two replicas or more, one of them
  untrusted, in a verified run) keeps a sketch of its own flat gradient contribution
  (``integrity.contributions.sketch``: ``SKETCH_SIZE`` floats). At the end of the step each watched
  stage's replicas send theirs to the lead verifier (trusted: ``wire.control.check_authorities``), point to
  point, and its ``ContributionMonitor`` flags the replica whose contribution stands out; the flags join
  the step's flag exchange (step-level events with a ``stage`` key), so blame and bans take them as
  they take any other. A replica reports its own sketch: a liar can report an honest-looking one while it
  sums a poisoned gradient (the monitor catches faults and attackers that do not lie about themselves);
  the robust sum below bounds what a liar can add either way. Where the lead also audits the stage and
  recomputed every microbatch of a replica's step, the sketch is audited against the recomputed sum
  (``audit_verdicts.contributions_heard``): a mismatch is a failed audit, a match withdraws the monitor's flag.
* With ``robust_reduce`` on the executor (see :func:`reduce_replicas`), the replicas' all-reduce becomes an
  all-gather of their contributions and every replica sums them by centered clipping
  (``integrity.robust_reduce``) from its stage's history, the same on every honest replica: one replica
  moves the step's gradient by at most the clipping radius. It costs an all-gather (each replica receives
  ``n - 1`` contributions where a ring all-reduce receives about two) and one pass over them.
  With three replicas or more gloo's all-gather forwards contributions through other replicas, which could
  alter them per receiver (honest replicas would then disagree); two replicas exchange directly.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from planner.integrity import robust_reduce
from planner.integrity.contributions import (
    SKETCH_SIZE,
    ContributionMonitor,
    sketch,
    sketch_seed,
)
from planner.runtime.rank import audit_verdicts
from planner.runtime.wire import comm, control
from planner.runtime.wire.grad_codecs import Int8ReduceState, PowerSGDState

HISTORY_BETA = 0.9   # the robust sum's reference (the EMA of its past results) and radius


def watched_stages(plan: Any) -> dict[int, tuple[int, ...]]:
    """Stage -> its ranks, for every stage with two replicas or more of which one is untrusted."""
    trusted = control.trusted_ranks(plan)
    out = {}
    for stage in range(plan.num_stages):
        ranks = tuple(plan.stage_ranks(stage))
        if len(ranks) >= 2 and any(r not in trusted for r in ranks):
            out[stage] = ranks
    return out


def _watched(ex: Any) -> dict[int, tuple[int, ...]]:
    if not hasattr(ex, "_watched_stages"):
        ex._watched_stages = watched_stages(ex.plan) if ex.verifying else {}
    return ex._watched_stages


def _powersgd(ex: Any, stage: int | None, ranks: Sequence[int]) -> PowerSGDState | None:
    """This replica's PowerSGD state where ``ranks`` are its stage's replicas and the plan compresses their
    all-reduce (made on first use from the replicated parameters' shapes, in ``_sum_grads``' order)."""
    if stage is None or tuple(ranks) != tuple(ex.groups.stage_ranks) or len(ranks) < 2:
        return None
    if ex.plan.stages[stage].allreduce_codec != "powersgd":
        return None
    shapes = tuple(p.shape for p in ex.replica_params)
    if getattr(ex, "_powersgd_state", None) is None or ex._powersgd_state.shapes != shapes:  # new stage: fresh
        ex._powersgd_state = PowerSGDState(shapes)
    return ex._powersgd_state


def _int8(ex: Any, stage: int | None, ranks: Sequence[int]) -> Int8ReduceState | None:
    """This replica's int8 all-reduce state where the plan puts its stage's all-reduce on int8 (as
    :func:`_powersgd`; the error-feedback buffer is kept across steps)."""
    if stage is None or tuple(ranks) != tuple(ex.groups.stage_ranks) or len(ranks) < 2:
        return None
    if ex.plan.stages[stage].allreduce_codec != "int8":
        return None
    values = sum(p.numel() for p in ex.replica_params)
    if getattr(ex, "_int8_state", None) is None or ex._int8_state.param_values != values:  # new stage: fresh
        ex._int8_state = Int8ReduceState(values)
    return ex._int8_state


def _gather(t: torch.Tensor, *, group: Any, ranks: Sequence[int], doing: str) -> list[torch.Tensor]:
    """Every rank of ``group``'s ``t`` (all of this one's size and dtype), in rank order."""
    parts = [torch.empty_like(t) for _ in ranks]
    try:
        dist.all_gather(parts, t, group=group)
    except comm.BACKEND_ERRORS as exc:
        raise comm.failure(exc, peer=None, doing=f"{doing} (ranks {list(ranks)})") from exc
    return parts


def _sum(ex: Any, flat: torch.Tensor, state: PowerSGDState | Int8ReduceState | None, *, group: Any,
         ranks: Sequence[int], doing: str) -> None:
    if state is None:
        comm.all_reduce_sum(flat, group=group, ranks=ranks, doing=doing)
        return
    if isinstance(state, Int8ReduceState):   # torch orders a group's ranks ascending
        state.reduce(flat, lambda t: _gather(t, group=group, ranks=ranks, doing=f"{doing} (int8)"), sorted(ranks))
        return
    state.reduce(flat, lambda t: comm.all_reduce_sum(t, group=group, ranks=ranks, doing=f"{doing} (PowerSGD)"))


def reduce_replicas(ex: Any, flat: torch.Tensor, *, group: Any, ranks: Sequence[int], doing: str) -> None:
    """The sum of ``flat`` over ``group`` in place (the executor's all-reduce hook), PowerSGD- or int8-compressed
    where the plan's stage says so (``wire.grad_codecs``). On a replica of a watched stage, summing its replicas'
    gradients (the trained count last when verifying), it first keeps the sketch of its own contribution for
    :func:`exchange` (poisoned first where a ``dir=params`` attack runs here), and sums by centered clipping
    where ``ex.robust_reduce`` is set: that sum needs every whole contribution, so it stays uncompressed
    whatever the plan's codec (the plan then prices the all-reduce below what it costs)."""
    stage = ex.info.stage if ex.stage is not None else None
    state = _powersgd(ex, stage, ranks) or _int8(ex, stage, ranks)
    replicas = stage is not None and tuple(ranks) == tuple(ex.groups.stage_ranks) and stage in _watched(ex)
    if not replicas:
        _sum(ex, flat, state, group=group, ranks=ranks, doing=doing)
        return
    grads = flat[:-1] if ex.verifying else flat
    if ex.attacks is not None and ex.attacks.active:
        grads.copy_(ex.attacks.poison_contribution(grads, step=ex.step))
    ex._replica_sketch = sketch(grads, seed=sketch_seed(0, stage))
    scaler = getattr(ex, "scaler", None)
    if scaler is not None:   # without fp16's loss scale (only the norm carries it): the monitor's norms survive a
        ex._replica_sketch[0] /= scaler.scale   # change of scale, a contribution audit recomputes unscaled
    if not getattr(ex, "robust_reduce", False):
        _sum(ex, flat, state, group=group, ranks=ranks, doing=doing)
        return
    parts = [torch.empty_like(flat) for _ in ranks]
    try:
        dist.all_gather(parts, flat, group=group)
    except comm.BACKEND_ERRORS as exc:
        raise comm.failure(exc, peer=None, doing=f"{doing}, gathering for a robust sum (ranks {list(ranks)})") from exc
    flat.copy_(robust_sum(ex, parts, counted=ex.verifying))


def robust_sum(ex: Any, parts: Sequence[torch.Tensor], *, counted: bool) -> torch.Tensor:
    """Centered clipping of the gathered contributions from this stage's history (kept on ``ex``), the trained
    counts (last element, where ``counted``) summed exactly; the history then learns the result."""
    grads = [p[:-1] if counted else p for p in parts]
    reference, radius = getattr(ex, "_robust_ref", None), getattr(ex, "_robust_radius", None)
    total = robust_reduce.centered_clip(grads, reference=reference, history_radius=radius)
    mean = total.float() / len(grads)
    if reference is not None:   # the radius learns distances clipped to it: an outlier grows it 5% a step at most
        cap = robust_reduce.HISTORY_FACTOR * radius if radius is not None else float("inf")
        spread = sum(min(float((g.float() - reference).norm()), cap) for g in grads) / len(grads)
        ex._robust_radius = spread if radius is None else HISTORY_BETA * radius + (1 - HISTORY_BETA) * spread
    ex._robust_ref = mean if reference is None else HISTORY_BETA * reference + (1 - HISTORY_BETA) * mean
    if not counted:
        return total
    return torch.cat([total, sum(p[-1:] for p in parts)])


def exchange(ex: Any, step: int) -> None:
    """Every watched stage's replicas send their sketches to the lead verifier, which judges them and adds
    its flags to the step's (before the verifiers exchange flags). Every rank calls it; the others return."""
    watched = _watched(ex)
    if not watched:
        return
    lead = min(ex.groups.verifier_ranks)
    mine = getattr(ex, "_replica_sketch", None)
    ex._replica_sketch = None
    for stage, ranks in sorted(watched.items()):
        if ex.rank != lead and ex.rank not in ranks:
            continue
        value = mine if ex.rank in ranks and mine is not None else torch.zeros(SKETCH_SIZE, dtype=torch.float64)
        got = control.gather_to(value.to(ex.device), dst=lead, me=ex.rank, ranks=sorted({*ranks, lead}),
                                topic=control.Topic.CONTRIB, device=ex.device, index=stage,
                                doing=f"sending stage {stage}'s gradient sketches to the lead verifier (step {step})")
        if got is None or ex.verify.verifier is None:
            continue
        if not hasattr(ex, "_contributions"):
            ex._contributions = ContributionMonitor()
        sketches = {r: got[r].cpu() for r in ranks}
        events = ex._contributions.judge(stage, sketches, step=step)
        # a contribution audit outranks the statistics: a vouched replica's flags withdrawn, its CUSUMs restarted
        vouched = audit_verdicts.contributions_heard(ex, stage, step, sketches)
        ex.verify.verifier.add_flags(step, [e for e in events if int(e["sender"]) not in vouched])
