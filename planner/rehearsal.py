"""What running a plan on this machine should take: the simulator priced with this machine's profile.

``stagewise run PLAN --emulate-speed`` rehearses a plan for remote devices
here. The plan's own prediction is for the planned devices (often orders
of magnitude faster than this CPU), so it cannot be compared with what the
rehearsal measures. Priced with a profile
of this machine (``stagewise profile``), the same programs give the figure
the rehearsal should measure: every rank's passes at the profiled speed,
padded as the runtime pads them, messages over the measured local link, and,
where the profile has them, the measured core sharing and per-message CPU
costs (``planner.simulate``). ``planner.profiling.rehearsal_times.predict_here`` first times the plan's own
stages, checks and blame here as the ranks run them (``LocalTimes``), which then replace the profile's block
model; a rehearsal's verified step ends with the verdict exchange (``simulate(verdicts=True)``).

On a CPU a float16 plan (the default for clusters with T4s or V100s) rehearses in bfloat16: CPUs have
no float16 matmul kernels worth the name (~24x slower than bfloat16 here), and both are 16-bit formats
with fp32 master weights, so the rehearsal still exercises the plan's mixed precision (loss scaling
aside). ``--rehearse-dtype plan`` keeps the plan's dtype.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cost_models.devices import load_profile_spec
from cost_models.measured import load_message_cost, load_sharing
from models.hf import is_hf_spec
from models.registry import PRESETS, ModelBundle, build_model
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel
from planner.plan import Plan
from planner.simulate import SimResult, simulate

REHEARSE_DTYPES: tuple[str, ...] = ("auto", "plan", "bf16", "fp16", "fp32")  # --rehearse-dtype
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MAX_TIMED_PARAMS = 50_000_000  # a larger model is not timed before a rehearsal (it would take seconds)
FIT_ERROR_WARN = 0.4  # a median block-time error above this: the calibration does not describe the blocks
BUSY_WARN = 0.25  # a machine this busy with other work: timings include that work


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalTimes:
    """What this machine's processes take for the plan's own work, timed as the rehearsal runs it
    (``planner.profiling.rehearsal_times``): per stage one microbatch's forward and backward CPU ms in the
    rehearsal's dtype, per checked (boundary, direction F/B) a verifier's check, and a verifier's
    end-of-step flags and blame, and per stage its optimizer's step (empty: priced by the profile). A pass
    after a wait finds its caches cold (``fwd_ms``, ``bwd_ms``); ``fwd_warm_ms``/``bwd_warm_ms``: the same pass
    right after another (empty: not timed), as a rank's later microbatches of a step mostly run."""

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    optim_ms: tuple[float, ...] = ()
    fwd_warm_ms: tuple[float, ...] = ()
    bwd_warm_ms: tuple[float, ...] = ()
    check_ms: tuple[tuple[int, str, float], ...] = ()
    blame_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LocalTimes:
        """The times a run's report holds (``Rehearsal.to_json``'s ``timed_here``)."""
        return cls(**{f.name: _tupled(doc[f.name]) for f in dataclasses.fields(cls) if f.name in doc})


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True, slots=True, kw_only=True)
class Rehearsal:
    """The simulated run and how it was priced."""

    result: SimResult
    cores: int
    device: str                 # the profiled device's name
    measured_sharing: bool      # core sharing from the profile (else even sharing)
    measured_messages: bool     # per-message CPU costs from the profile (else free)
    dtype: str = "float32"      # the compute dtype the ranks run here
    pass_scale: tuple[float, float] | None = None  # (forward, backward) passes measured here over the profile's
    #                                                 float32 prices (None: not timed)
    timed: bool = False         # the stages and checks were timed here as the rehearsal runs them
    costs: CostModel | None = field(default=None, compare=False)  # the prices simulated
    warnings: tuple[str, ...] = ()  # why the profile may not describe this machine as it runs now
    local: LocalTimes | None = None  # the times measured here that priced it (None: the profile's alone)

    def to_json(self) -> dict[str, Any]:
        """What a run's report keeps of the prediction: the step, how it was priced, the times measured here."""
        return {"step_ms": self.result.step_ms, "profile": self.device, "cores": self.cores, "dtype": self.dtype,
                "timed": self.timed, "pass_scale": self.pass_scale, "warnings": list(self.warnings),
                "timed_here": None if self.local is None else self.local.to_json()}


def local_device_type(backend: str = "auto") -> str:
    """The device a local run's ranks compute on: ``cuda`` or ``cpu`` (as ``rank_device`` picks it)."""
    return "cuda" if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()) else "cpu"


def rehearsal_dtype(plan: Plan, requested: str = "auto", device_type: str = "cpu") -> str:
    """The compute dtype a local run of ``plan`` uses: ``requested`` (``--rehearse-dtype``), where ``auto``
    is the plan's own except float16 on a CPU, which runs as bfloat16 (module docstring)."""
    if requested not in REHEARSE_DTYPES:
        raise InvalidInputError("--rehearse-dtype", expected=" or ".join(REHEARSE_DTYPES), found=repr(requested))
    if requested == "plan" or (requested == "auto" and not (device_type == "cpu"
                                                              and plan.config.dtype == "float16")):
        return plan.config.dtype
    return "bfloat16" if requested == "auto" else _DTYPE_NAMES[requested]


def as_rehearsed(plan: Plan, requested: str = "auto", device_type: str = "cpu") -> Plan:
    """``plan`` computing in :func:`rehearsal_dtype` (the plan itself when that is its own)."""
    dtype = rehearsal_dtype(plan, requested, device_type)
    if dtype == plan.config.dtype:
        return plan
    config = dataclasses.replace(plan.config, dtype=dtype, mixed_precision=dtype != "float32")
    return dataclasses.replace(plan, config=config)


def rehearsal_note(plan: Plan, requested: str = "auto", device_type: str = "cpu") -> str | None:
    """One line when the rehearsal computes in another dtype than the plan's, else None."""
    dtype = rehearsal_dtype(plan, requested, device_type)
    if dtype == plan.config.dtype:
        return None
    why = (f"the plan's {plan.config.dtype} runs ~24x slower on a CPU" if requested == "auto"
           else "as --rehearse-dtype asks")
    return (f"rehearsing in {dtype}, not the plan's {plan.config.dtype}: {why} "
            f"(--rehearse-dtype plan keeps the plan's)")


def profile_warnings(doc: dict, *, busy_now: float = 0.0) -> tuple[str, ...]:
    """Why a prediction from this profile may be far off: a poor block fit, or a machine busy with
    other work when it was profiled or now (its timings are then not this machine's own speed)."""
    out = []
    err = (doc.get("calibration") or {}).get("median_abs_rel_err")
    if err is not None and err > FIT_ERROR_WARN:
        out.append(f"the profile's block times fit its model {100 * err:.0f}% off (median)")
    before = (doc.get("host") or {}).get("busy_fraction_before")
    if before is not None and before > BUSY_WARN:
        out.append(f"the machine was {100 * before:.0f}% busy with other work when profiled")
    if busy_now > BUSY_WARN:
        out.append(f"the machine is {100 * busy_now:.0f}% busy with other work now")
    host = doc.get("host") or {}
    if host.get("device") == "cpu" and (host.get("torch_threads") or 1) > 1:  # ranks compute on one thread each
        out.append(f"the profile timed its blocks on {host['torch_threads']} torch threads, the ranks compute on 1 "
                   "(profile with --threads 1)")
    return tuple(out)


def predict_rehearsal(plan: Plan, profile: str | Path, *, emulate: bool, slowdown: float = 1.0,
                      cores: int | None = None, busy_now: float = 0.0, dtype: str = "auto",
                      local: LocalTimes | None = None, clip: bool = False, accumulate: int = 1) -> Rehearsal:
    """The simulated ``stagewise run`` of ``plan`` on the machine ``profile`` describes (``emulate``:
    ``--emulate-speed``; ``slowdown``: ``--emulate-slowdown``; ``dtype``: ``--rehearse-dtype``), its ranks
    sharing ``cores`` processors (default: the profile's sharing table's, else this machine's); ``busy_now``:
    the share of this machine's processors others use now (it makes the prediction unreliable); ``local``:
    the plan's stages and checks timed here in the rehearsal's dtype (else the profile's block model, scaled
    by one timed pass of the whole model); ``clip``, ``accumulate``: the run's ``--clip-grad`` (given or not)
    and ``--accumulate``."""
    spec = load_profile_spec(profile)   # checks the file; the document is then read once for the rest
    plan = as_rehearsed(plan, dtype, spec.kind)
    doc = json.loads(Path(profile).read_text())
    sharing, messages = load_sharing(doc), load_message_cost(doc)
    if cores is None:
        cores = sharing.cores if sharing is not None else os.cpu_count() or 1
    costs = CostModel.for_rehearsal(plan, spec, emulate=emulate, slowdown=slowdown)
    scale, unmodelled = None, ()
    if local is not None:
        _use_local_times(costs, local)
    elif spec.kind == "cpu":
        fp32 = dataclasses.replace(plan, config=dataclasses.replace(plan.config, dtype="float32",
                                                                    mixed_precision=False))
        blocks = CostModel.for_rehearsal(fp32, spec, emulate=False)
        scale = pass_scale(plan, blocks)
        if scale is not None:
            _price_local_passes(costs, blocks, scale)
        elif plan.config.dtype != "float32":
            unmodelled = ((f"{plan.config.dtype} passes are priced at the profile's {plan.config.dtype} matmul "
                           "peak (the profile times float32 blocks, and only a preset or hf: model up to "
                           f"{MAX_TIMED_PARAMS / 1e6:.0f}M parameters is timed here)"),)
    result = simulate(plan, costs, cores=cores, sharing=sharing, emulated=emulate, messages=messages, clip=clip,
                      accumulate=accumulate, verdicts=True)
    warnings = profile_warnings(doc, busy_now=busy_now) + unmodelled
    return Rehearsal(result=result, cores=cores, device=spec.name, measured_sharing=sharing is not None,
                     measured_messages=messages is not None, warnings=warnings, dtype=plan.config.dtype,
                     pass_scale=scale, costs=costs, timed=local is not None, local=local)


def _use_local_times(costs: CostModel, local: LocalTimes) -> None:
    """Each rank's passes and checks at the times measured here, their padding kept."""
    if len(local.fwd_ms) != len(costs.ranges) or len(local.bwd_ms) != len(costs.ranges):
        raise InvalidInputError("timed stages", expected=f"{len(costs.ranges)} (the plan's)",
                                found=str(len(local.fwd_ms)), fix="time the plan being rehearsed")
    for r, info in enumerate(costs.ranks):
        if info.stage is not None:
            _reprice(costs, r, *_mean_pass_ms(local, info.stage, len(info.microbatches)))
            if local.optim_ms:
                costs._optim[r] = local.optim_ms[info.stage]
    costs.measured_checks = {(b, d): ms for b, d, ms in local.check_ms}
    costs.blame_ms = local.blame_ms


def _mean_pass_ms(local: LocalTimes, stage: int, microbatches: int) -> tuple[float, float]:
    """A rank's mean forward and backward over its ``microbatches`` of a step: the first cold, the rest warm
    where warm passes were timed (gpt-tiny, 2 stages x 4 microbatches: 20.2 ms of passes a step measured, cold
    prices alone said 24.8)."""
    if not local.fwd_warm_ms or microbatches <= 1:
        return local.fwd_ms[stage], local.bwd_ms[stage]
    later = microbatches - 1
    return ((local.fwd_ms[stage] + later * local.fwd_warm_ms[stage]) / microbatches,
            (local.bwd_ms[stage] + later * local.bwd_warm_ms[stage]) / microbatches)


def _price_local_passes(costs: CostModel, local: CostModel, scale: tuple[float, float]) -> None:
    """Each rank's forward and backward here at ``scale`` x their float32 price from the profile (``local``:
    the plan priced here in float32, unpadded), their padding kept."""
    for r, info in enumerate(costs.ranks):
        if info.stage is not None:
            _reprice(costs, r, scale[0] * local._fwd[r], scale[1] * local._bwd[r])


def _reprice(costs: CostModel, rank: int, fwd_ms: float, bwd_ms: float) -> None:
    """``rank``'s passes compute ``fwd_ms``/``bwd_ms`` here, padded by the same factors as before."""
    local_f, local_b = costs._local[rank]
    pad_f = costs._fwd[rank] / local_f if local_f > 0 else 1.0
    pad_b = costs._bwd[rank] / local_b if local_b > 0 else 1.0
    costs._local[rank] = (fwd_ms, bwd_ms)
    costs._fwd[rank], costs._bwd[rank] = pad_f * fwd_ms, pad_b * bwd_ms


def timeable(plan: Plan) -> bool:
    """Whether this process may build and time ``plan``'s model: a preset or hf: config (a plan never makes
    this process import code) small enough to time in a moment."""
    spec = plan.model.spec
    return (spec in PRESETS or is_hf_spec(spec)) and plan.chain().param_count <= MAX_TIMED_PARAMS


def pass_scale(plan: Plan, local: CostModel, *, repeats: int = 5) -> tuple[float, float] | None:
    """The CPU time of a forward and of a backward of the plan's whole model here (one microbatch, one thread
    as every rank, its compute dtype, the least of ``repeats``) over the profile's float32 price of its stages
    (``local``); None for a model that is no preset or hf: config (a plan never makes this process import
    code) or is too large to time in a moment.

    The profile fits its block model at one small shape in float32; the rehearsal runs the plan's microbatch,
    and a CPU's bfloat16 is no faster for small passes for all its matmul peak (AMX): autocast casts every
    weight on every pass (gpt-tiny's passes take ~2.4x float32's here), and its backward costs ~3.5x its
    forward where the profile's float32 blocks cost ~2x: the two are scaled apart. The profile still splits
    the time between the stages."""
    if not timeable(plan):
        return None
    ref = plan.model
    first = [next(r for r, info in enumerate(plan.ranks) if info.stage == k) for k in range(plan.num_stages)]
    priced_f = sum(local.compute_ms(r, "F") for r in first)
    priced_b = sum(local.compute_ms(r, "B") for r in first)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bundle = build_model(ref.spec, batch=plan.config.microbatch_size, seq=ref.seq, device="cpu", seed=0)
        dtype = None if plan.config.dtype == "float32" else getattr(torch, plan.config.dtype)
        fwd_s, bwd_s = _least_pass_s(bundle, dtype, repeats)
    finally:
        torch.set_num_threads(threads)
    if priced_f <= 0 or priced_b <= 0:
        return None
    return 1e3 * fwd_s / priced_f, 1e3 * bwd_s / priced_b


def _least_pass_s(bundle: ModelBundle, dtype: torch.dtype | None, repeats: int) -> tuple[float, float]:
    """The least CPU seconds of a forward and of a backward of ``bundle``'s module over ``repeats`` runs."""
    best_f = best_b = float("inf")
    for i in range(repeats + 1):  # the first warms up
        start = time.thread_time()
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            out = bundle.module(*bundle.example_inputs)
        loss = out.float().sum()
        middle = time.thread_time()
        loss.backward()
        if i:
            best_f, best_b = min(best_f, middle - start), min(best_b, time.thread_time() - middle)
        bundle.module.zero_grad(set_to_none=True)
    return best_f, best_b
