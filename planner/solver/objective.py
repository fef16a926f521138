"""The closed-form iteration time of a placement: the one cost model every search code path uses.

The model (all times in ms; ``M`` microbatches; stages ``k = 0..S-1``):

* Stage ``k`` holds blocks ``first..last`` on replicas ``i`` (device ``d_i``)
  that run ``m_i`` of the ``M`` microbatches (``sum m_i = M``). Per
  microbatch a replica spends

  - ``comp_i`` = forward + backward of the stage's blocks on ``d_i``;
  - ``comm_i`` = what it sends, with no overlap ("exposed"): the activation
    to the next stage (``transfer(B_k)`` over the slowest link from ``d_i``
    to a next-stage replica), the gradient to the previous stage
    (``transfer(B_{k-1})``, likewise), and for every checked direction it
    sends, an extra copy to the boundary's verifier unless that verifier is
    the single device receiving the tensor anyway. ``B_k`` is the boundary
    tensor after the stage's last block; ``transfer(B) = latency + B /
    bandwidth`` (``cost_models.comm.transfer_ms``);
  - ``vload_i`` = the verify time (``problem.verify_ms``) of every boundary
    direction it checks, for all ``M`` microbatches.

  ``t_k = max_i (m_i * (comp_i + comm_i) + M * vload_i) / M``: with one
  replica, ``t_k = comp + comm + vload``; replicas split the microbatches.
* A device that verifies but runs no stage (a CPU verifier host) has a
  per-microbatch load ``v_d`` = the verify time of what it checks.
* ``T = max(max_k t_k, max_d v_d)``; a replicated stage all-reduces its
  gradients once per step: ``AR_k = cost_models.comm.allreduce_ms`` over the
  ring of its replicas; the groups all-reduce concurrently.
* **Iteration time** ``F = sum_k t_k + (M - 1) * T + max_k AR_k``.

Memory of a stage replica: ``params * (weights + grads + optimizer bytes) +
saved activations * in-flight + comm buffers + verifier state`` with in-flight
``cost_models.memory.in_flight_microbatches(schedule, S, k, m_i)`` (GPipe
``m_i``; 1F1B ``min(m_i, S - k)``) and verifier state
``VERIFIER_STATE_COPIES * B`` per checked boundary direction.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from cost_models import codecs, comm, memory
from cost_models.codecs import ALLREDUCE_STATE_BYTES_PER_PARAM
from planner.errors import InvalidInputError
from planner.solver.problem import VERIFIER_STATE_COPIES, Problem
from planner.solver.problem_memo import ProblemMemo
from planner.solver.program_cost import ProgramCost, program_cost
from planner.solver.solution import (
    StagePlacement,
    VerifierPlacement,
    shared_boundary_problem,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Stages and verifiers at ``num_microbatches``: what the objective prices."""

    stages: tuple[StagePlacement, ...]
    verifiers: tuple[VerifierPlacement, ...]
    num_microbatches: int

    def __post_init__(self) -> None:
        if not self.stages:
            raise InvalidInputError("placement", expected="at least one stage", found="none")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def verifier_of(self, boundary: int) -> VerifierPlacement | None:
        """The boundary's (first) verifier; :meth:`checker_of` for the one that checks a given sender."""
        for v in self.verifiers:
            if v.boundary == boundary:
                return v
        return None

    def checker_of(self, boundary: int, direction: str, sender: str) -> VerifierPlacement | None:
        """The verifier that checks what ``sender`` sends across ``boundary`` in ``direction`` (None: unchecked)."""
        for v in self.verifiers:
            if v.boundary == boundary and direction in v.directions and v.covers(sender):
                return v
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    """The priced placement: per-stage times, the iteration time and memory per device."""

    stage_ms: tuple[float, ...]
    verifier_only_ms: tuple[tuple[str, float], ...]
    bottleneck_ms: float
    allreduce_ms: float
    step_ms: float
    memory_bytes: tuple[tuple[str, int], ...]
    over_memory: tuple[str, ...]


def even_split(num_microbatches: int, replicas: int) -> tuple[int, ...]:
    """Microbatches per replica of identical devices: as even as possible, larger shares first."""
    q, rem = divmod(num_microbatches, replicas)
    return tuple(q + 1 if i < rem else q for i in range(replicas))


def required_directions(problem: Problem, stages: tuple[StagePlacement, ...], boundary: int) -> tuple[str, ...]:
    """Directions of ``boundary`` that must be checked: those whose sender has an untrusted device."""
    pol = problem.policy
    if not pol.enabled:
        return ()

    def untrusted(st: StagePlacement) -> bool:
        return any(not problem.classes[problem.class_of(d)].trusted for d in st.devices)

    dirs = []
    if untrusted(stages[boundary]):
        dirs.append("act")
    if pol.check_gradients and untrusted(stages[boundary + 1]):
        dirs.append("grad")
    return tuple(dirs)


def _sole_receiver(stage: StagePlacement, device: str) -> bool:
    return stage.devices == (device,)


def _slowest_transfer_ms(problem: Problem, nbytes: float, dev: str, peers: tuple[str, ...]) -> float:
    """The slowest transfer from ``dev`` to any of ``peers``: links depend on device classes only, so one
    per class (a wide replica group has far fewer classes than devices)."""
    one_per_class = {problem.class_of(d): d for d in peers}
    return max(problem.transfer_ms(nbytes, dev, d) for d in one_per_class.values())


def _send_ms(problem: Problem, placement: Placement, k: int, dev: str) -> float:
    """Per-microbatch send time of replica ``dev`` of stage ``k`` (activation, gradient, verifier copies)."""
    stages, S = placement.stages, placement.num_stages
    total = 0.0
    if k < S - 1:
        nbytes = problem.wire_bytes(stages[k].last_block, stages[k].out_codec)
        total += _slowest_transfer_ms(problem, nbytes, dev, stages[k + 1].devices)
        v = placement.checker_of(k, "act", dev)
        if v is not None and v.device != dev and not _sole_receiver(stages[k + 1], v.device):
            total += problem.transfer_ms(nbytes, dev, v.device)
    if k > 0:
        nbytes = problem.wire_bytes(stages[k - 1].last_block, stages[k - 1].out_codec)
        total += _slowest_transfer_ms(problem, nbytes, dev, stages[k - 1].devices)
        v = placement.checker_of(k - 1, "grad", dev)
        if v is not None and v.device != dev and not _sole_receiver(stages[k - 1], v.device):
            total += problem.transfer_ms(nbytes, dev, v.device)
    return total


def _verify_load(problem: Problem, placement: Placement) -> dict[str, float]:
    """Per-microbatch verify time of every device that hosts verifiers."""
    load: dict[str, float] = {}
    for v in placement.verifiers:
        nbytes = problem.raw_bytes(placement.stages[v.boundary].last_block)  # checked decoded
        cls = problem.class_of(v.device)
        load[v.device] = load.get(v.device, 0.0) + checked_share(placement, v) * problem.verify_ms(nbytes, cls)
    return load


def checked_share(placement: Placement, v: VerifierPlacement) -> float:
    """The microbatches ``v`` checks per step over ``M``, summed over its directions: 1 a direction where it
    watches every sender, its senders' share of the microbatches where it watches some."""
    stages, M = placement.stages, placement.num_microbatches
    share = 0.0
    for direction in v.directions:
        st = stages[v.boundary] if direction == "act" else stages[v.boundary + 1]
        share += sum(m for d, m in zip(st.devices, st.microbatches) if v.covers(d)) / M
    return share


def _verifier_state(problem: Problem, placement: Placement) -> dict[str, int]:
    state: dict[str, int] = {}
    for v in placement.verifiers:
        nbytes = int(problem.out_bytes_int[placement.stages[v.boundary].last_block])
        state[v.device] = state.get(v.device, 0) + VERIFIER_STATE_COPIES * nbytes * len(v.directions)
    return state


def stage_memory_bytes(problem: Problem, st: StagePlacement, num_stages: int, share: int,
                       in_flight: int | None = None) -> int:
    """Bytes one replica running ``share`` microbatches of stage ``st`` holds (verifier state excluded), with
    ``in_flight`` microbatches' activations at most (default: the schedule's least)."""
    if in_flight is None:
        in_flight = memory.in_flight_microbatches(problem.schedule, num_stages, st.index, share)
    problem = problem.tables(st.recompute)
    state = problem.state_bytes_per_param + ALLREDUCE_STATE_BYTES_PER_PARAM[st.allreduce_codec or "none"]
    return (problem.range_params(st.first_block, st.last_block) * state
            + problem.range_act_bytes(st.first_block, st.last_block) * in_flight
            + problem.buffer_bytes(st.first_block, st.last_block))


def allreduce_ms(problem: Problem, st: StagePlacement) -> float:
    """Gradient all-reduce of a replicated stage: a ring over its replicas in order (compressed under its
    ``allreduce_codec``: ``cost_models.codecs.powersgd_allreduce_ms``, ``int8_allreduce_ms``)."""
    r = len(st.devices)
    if r < 2:
        return 0.0
    ring = tuple(problem.link(a, b) for a, b in zip(st.devices, st.devices[1:] + st.devices[:1]))
    params = problem.range_params(st.first_block, st.last_block)
    codec = problem.allreduce_codec if st.allreduce_codec is None else st.allreduce_codec
    if codec == "int8":
        slowest_bw = min(problem.classes[problem.class_of(d)].spec.mem_bw_bytes_per_s for d in st.devices)
        return codecs.int8_allreduce_ms(params, ring, r, slowest_bw)
    if codec == "powersgd":
        counts = problem.param_tensors
        tensors = 1 if counts is None else int(counts[st.first_block:st.last_block + 1].sum())
        slowest = min((problem.classes[problem.class_of(d)].spec for d in st.devices),
                      key=lambda s: s.effective_flops_per_s("float32"))
        return codecs.powersgd_allreduce_ms(params, tensors, ring, r, slowest.effective_flops_per_s("float32"),
                                            slowest.mem_bw_bytes_per_s)
    return comm.allreduce_ms(params * problem.grad_bytes_per_param, ring, r)


def evaluate(problem: Problem, placement: Placement) -> Evaluation:
    """Price ``placement`` with the model of the module docstring."""
    M, S = placement.num_microbatches, placement.num_stages
    vload = _verify_load(problem, placement)
    vstate = _verifier_state(problem, placement)
    stage_ms, mem, over = [], {}, []
    checkers = {v.device for v in placement.verifiers}
    sends: dict[tuple, float] = {}  # replicas of one class send alike (unless one is a verifier): price once
    for k, st in enumerate(placement.stages):
        worst = 0.0
        for dev, m in zip(st.devices, st.microbatches):
            cls = problem.class_of(dev)
            key = (k, dev) if dev in checkers else (k, cls)
            if key not in sends:
                sends[key] = _send_ms(problem, placement, k, dev)
            per_mb = problem.tables(st.recompute).range_time_ms(st.first_block, st.last_block, cls) + sends[key]
            worst = max(worst, (m * per_mb + M * vload.get(dev, 0.0)) / M)
            mem[dev] = stage_memory_bytes(problem, st, S, m) + vstate.get(dev, 0)
        stage_ms.append(worst)
    on_stage = set(mem)
    verifier_only = tuple((d, ms) for d, ms in vload.items() if d not in on_stage)
    for d in vload:
        if d not in on_stage:
            mem[d] = vstate.get(d, 0)
    for d, b in mem.items():
        if b > problem.classes[problem.class_of(d)].mem_bytes:
            over.append(d)
    bottleneck = max(stage_ms + [ms for _, ms in verifier_only])
    ar = max(allreduce_ms(problem, st) for st in placement.stages)
    step = sum(stage_ms) + (M - 1) * bottleneck + ar
    return Evaluation(stage_ms=tuple(stage_ms), verifier_only_ms=verifier_only, bottleneck_ms=bottleneck,
                      allreduce_ms=ar, step_ms=step, memory_bytes=tuple(mem.items()), over_memory=tuple(over))


def violations(problem: Problem, placement: Placement, evaluation: Evaluation | None = None) -> tuple[str, ...]:
    """Every rule the placement breaks (empty: a valid plan). Used by heuristics to discard candidates."""
    out: list[str] = []
    stages, M, pol = placement.stages, placement.num_microbatches, problem.policy
    if stages[0].first_block != 0 or stages[-1].last_block != problem.num_blocks - 1:
        out.append("stages do not cover the chain")
    for a, b in itertools.pairwise(stages):
        if b.first_block != a.last_block + 1:
            out.append(f"stages {a.index} and {b.index} are not contiguous")
    seen: set[str] = set()
    for st in stages:
        if sum(st.microbatches) != M:
            out.append(f"stage {st.index} runs {sum(st.microbatches)} of {M} microbatches")
        for d in st.devices:
            c = problem.classes[problem.class_of(d)]
            if d in seen:
                out.append(f"device {d} runs two stages")
            if not c.stage_capable:
                out.append(f"device {d} cannot run a stage")
            seen.add(d)
    if pol.enabled and pol.trusted_endpoints:
        for st in (stages[0], stages[-1]):
            if any(not problem.classes[problem.class_of(d)].trusted for d in st.devices):
                out.append(f"stage {st.index} is an endpoint on an untrusted device")
    out.extend(_verifier_violations(problem, placement))
    ev = evaluation or evaluate(problem, placement)
    out.extend(f"device {d} is over its memory" for d in ev.over_memory)
    return tuple(out)


def _verifier_violations(problem: Problem, placement: Placement) -> list[str]:
    out: list[str] = []
    stages, pol = placement.stages, problem.policy
    per_device: dict[str, int] = {}
    stage_devices = {d for st in stages for d in st.devices}
    for b in range(placement.num_stages - 1):
        need = required_directions(problem, stages, b)
        group = [v for v in placement.verifiers if v.boundary == b]
        out.extend(f"verifier {v.device} of boundary {b} names a sender the boundary no longer has"
                   for v in group if set(v.senders) - set(boundary_senders(stages, b, v.directions)))
        if not need:
            continue
        senders = boundary_senders(stages, b, need)
        if not group or any(not set(need) <= set(v.directions) - set(v.watch_only) for v in group) \
                or any(not any(v.covers(s) for v in group) for s in senders):
            out.append(f"boundary {b} is not checked in {need}")
            continue
        shared = shared_boundary_problem(group)
        if shared:
            out.append(shared)
        for v in group:
            out.extend(_site_violations(problem, placement, v, [s for s in senders if v.covers(s)], stage_devices))
            per_device[v.device] = per_device.get(v.device, 0) + 1
    cap = pol.max_boundaries_per_verifier
    if cap is not None:
        out.extend(f"verifier {d} checks {n} boundaries (max {cap})" for d, n in per_device.items() if n > cap)
    return out


def boundary_senders(stages: Sequence[StagePlacement], b: int, directions: Sequence[str]) -> tuple[str, ...]:
    """The devices that send across boundary ``b`` in ``directions``: stage ``b``'s activations, ``b + 1``'s
    gradients."""
    return (stages[b].devices if "act" in directions else ()) + (stages[b + 1].devices if "grad" in directions else ())


def _site_violations(problem: Problem, placement: Placement, v: VerifierPlacement, senders: list[str],
                     stage_devices: set[str]) -> list[str]:
    """What ``v``'s site breaks: trust, the domains of the ``senders`` it checks, the policy's placement."""
    out, pol, b = [], problem.policy, v.boundary
    c = problem.classes[problem.class_of(v.device)]
    if not c.trusted:
        out.append(f"verifier {v.device} of boundary {b} is untrusted")
    domains = {problem.classes[problem.class_of(s)].domain for s in senders} - {None}
    if c.domain is not None and c.domain in domains:
        out.append(f"verifier {v.device} of boundary {b} shares the sender's trust domain")
    if pol.verifier_placement == "stage" and v.device not in stage_devices:
        out.append(f"verifier {v.device} runs no stage (policy: stage)")
    if pol.verifier_placement == "cpu" and not c.verifier_host:
        out.append(f"verifier {v.device} is not a CPU verifier host (policy: cpu)")
    if pol.verifier_placement == "any" and v.device not in stage_devices and not c.verifier_host:
        out.append(f"verifier {v.device} is neither a stage device nor a verifier host")
    return out


# --- a lower bound on the bottleneck of any plan ----------------------------
def fluid_bottleneck_ms(problem: Problem) -> float:
    """A lower bound on the bottleneck ``T`` of any plan: :func:`fluid_bound` with no fill term."""
    return _fluid_lp(problem, with_fill=False)


def program_lower_bound_ms(problem: Problem) -> float:
    """A lower bound on the compiled programs' cost (``price_program``) of every plan: ``M`` times the fluid
    bottleneck (a class's devices share ``M`` microbatches' work on its blocks); infinite where the LP proves no
    plan holds its blocks in memory. Not :func:`simple_lower_bound_ms`'s fill term, which bounds the closed form
    only: where stage 0 is the bottleneck, its warm-up forwards hide the other stages' passes in the programs
    (one A100 holding a 244 ms block, another the rest, 4 microbatches: the programs cost 997.6 ms, the fill
    term says 1,107.6). Nor below one microbatch's own path: its forward and backward through every block in
    turn, each on the class that runs it fastest (with one microbatch, or few, the path is what binds)."""
    stage = [c.index for c in problem.classes if c.stage_capable]
    path = float(problem.time_ms[:, stage].min(axis=1).sum()) * (1 - 1e-9) if stage else 0.0
    return max(problem.num_microbatches * _fluid_lp(problem, with_fill=False, infeasible=math.inf), path)


def simple_lower_bound_ms(problem: Problem) -> float:
    """A lower bound on the closed form ``F`` (``evaluate``) valid for every plan (any stage count, replicas,
    verifiers): the fluid LP; infinite where the LP proves no plan holds its blocks in memory (such a microbatch
    count must not bound the others). For the compiled programs' cost use :func:`program_lower_bound_ms`."""
    return _fluid_lp(problem, with_fill=True, infeasible=math.inf)


def _fluid_lp(problem: Problem, *, with_fill: bool, infeasible: float = 0.0) -> float:
    """min ``sum_lc x_lc h_c time_lc + (M - 1) T`` (or ``T`` alone) over fractional block -> class assignments.

    Why it bounds every plan: give block ``l`` to its stage's class (``x`` 0/1).
    A stage of ``r`` replicas takes ``t >= ceil(M/r)/M * work >= h_c * work``
    per microbatch (``h_c``: the class's smallest share), so the stage times
    sum to at least the fill term. A replica running ``m`` of ``M``
    microbatches is busy ``m * t <= M * T``, so a class's ``n_c`` devices do
    at most ``n_c T`` of per-microbatch work: ``sum_l x_lc time_lc <= n_c T``.
    Each device holds its blocks' weights, gradients, optimizer state and at
    least one microbatch of activations: ``sum_l x_lc mem_l <= n_c cap_c``.
    ``T`` is also at least the slowest block's best time. Returns ``infeasible``
    when the LP proves there is no assignment (no plan exists), 0 when it has no
    answer otherwise (the trivial bound).
    """
    M, L = problem.num_microbatches, problem.num_blocks
    stage = [c for c in problem.classes if c.stage_capable]
    if not stage:
        return 0.0
    share = {c.index: math.ceil(M / max(problem.replica_choices(c.index))) / M for c in stage}
    per_block = float(np.max(np.min([share[c.index] * problem.time_ms[:, c.index] for c in stage], axis=0)))
    lp = pywraplp.Solver.CreateSolver("GLOP")
    inf = lp.infinity()
    T = lp.NumVar(per_block, inf, "T")
    obj = lp.Objective()
    obj.SetCoefficient(T, (M - 1) if with_fill else 1)
    need = problem.param_count.astype(float) * problem.state_bytes_per_param + problem.act_bytes
    cover = [lp.Constraint(1, 1) for _ in range(L)]
    for c in stage:
        busy = lp.Constraint(-inf, 0)  # sum x t - n T <= 0
        busy.SetCoefficient(T, -c.count)
        mem = lp.Constraint(-inf, c.count)  # sum x m / cap <= n (well scaled)
        for l in range(L):
            if need[l] > c.mem_bytes:
                continue
            x = lp.NumVar(0, 1, "")
            tl = float(problem.time_ms[l, c.index])
            cover[l].SetCoefficient(x, 1)
            busy.SetCoefficient(x, tl)
            mem.SetCoefficient(x, float(need[l]) / c.mem_bytes)
            if with_fill:
                obj.SetCoefficient(x, share[c.index] * tl)
    obj.SetMinimization()
    status = lp.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return infeasible
    if status != pywraplp.Solver.OPTIMAL:
        return 0.0
    return max(0.0, obj.Value() * (1 - 1e-7))  # shave the LP tolerance: stays a valid bound


def program_memory(problem: Problem, placement: Placement, in_flight: tuple[tuple[int, ...], ...]
                   ) -> tuple[tuple[str, int], ...]:
    """Bytes per device when its stage replica keeps ``in_flight`` microbatches' activations at most."""
    vstate = _verifier_state(problem, placement)
    mem = dict(vstate)
    for st, limits in zip(placement.stages, in_flight):
        for dev, m, n in zip(st.devices, st.microbatches, limits):
            mem[dev] = stage_memory_bytes(problem, st, placement.num_stages, m, n) + vstate.get(dev, 0)
    return tuple(mem.items())


# Prices already computed: the searches price the same plans again (the hill-climb's neighbours' neighbours, a
# count's plans ranked for the climb, then for the grids and recomputation), and a pricing runs the programs
# (milliseconds).
_PRICES: ProblemMemo[ProgramCost] = ProblemMemo(kept=4096)


def price_program(problem: Problem, placement: Placement) -> ProgramCost:
    """The step of the programs ``placement`` compiles to (``program_cost``): what a returned plan costs."""
    return _PRICES.get(problem, placement, lambda: _priced(problem, placement))


def _priced(problem: Problem, placement: Placement) -> ProgramCost:
    return program_cost(problem, placement.stages, placement.verifiers, verify_load=_verify_load(problem, placement),
                        verifier_state=_verifier_state(problem, placement),
                        allreduce_ms=tuple(allreduce_ms(problem, st) for st in placement.stages))
