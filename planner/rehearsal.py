"""What running a plan on this machine should take: the simulator priced with this machine's profile.

``stagewise run PLAN --emulate-speed`` rehearses a plan for remote devices
here. The plan's own prediction is for the planned devices (often orders
of magnitude faster than this CPU), so it cannot be compared with what the
rehearsal measures. Priced with a profile
of this machine (``stagewise profile``), the same programs give the figure
the rehearsal should measure: every rank's passes at the profiled speed,
padded as the runtime pads them, messages over the measured local link, and,
where the profile has them, the measured core sharing and per-message CPU
costs (``planner.simulate``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cost_models.devices import load_profile_spec
from cost_models.measured import load_message_cost, load_sharing
from planner.instruction_costs import CostModel
from planner.plan import Plan
from planner.simulate import SimResult, simulate

FIT_ERROR_WARN = 0.4  # a median block-time error above this: the calibration does not describe the blocks
BUSY_WARN = 0.25  # a machine this busy with other work: timings include that work


@dataclass(frozen=True, slots=True, kw_only=True)
class Rehearsal:
    """The simulated run and how it was priced."""

    result: SimResult
    cores: int
    device: str                 # the profiled device's name
    measured_sharing: bool      # core sharing from the profile (else even sharing)
    measured_messages: bool     # per-message CPU costs from the profile (else free)
    warnings: tuple[str, ...] = ()  # why the profile may not describe this machine as it runs now


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
    return tuple(out)


def predict_rehearsal(plan: Plan, profile: str | Path, *, emulate: bool, slowdown: float = 1.0,
                      cores: int | None = None, busy_now: float = 0.0) -> Rehearsal:
    """The simulated ``stagewise run`` of ``plan`` on the machine ``profile`` describes (``emulate``:
    ``--emulate-speed``; ``slowdown``: ``--emulate-slowdown``), its ranks sharing ``cores`` processors
    (default: the profile's sharing table's, else this machine's); ``busy_now``: the share of this
    machine's processors others use now (it makes the prediction unreliable)."""
    spec = load_profile_spec(profile)   # checks the file; the document is then read once for the rest
    doc = json.loads(Path(profile).read_text())
    sharing, messages = load_sharing(doc), load_message_cost(doc)
    if cores is None:
        cores = sharing.cores if sharing is not None else os.cpu_count() or 1
    costs = CostModel.for_rehearsal(plan, spec, emulate=emulate, slowdown=slowdown)
    result = simulate(plan, costs, cores=cores, sharing=sharing, emulated=emulate, messages=messages)
    warnings = profile_warnings(doc, busy_now=busy_now)
    return Rehearsal(result=result, cores=cores, device=spec.name, measured_sharing=sharing is not None,
                     measured_messages=messages is not None, warnings=warnings)
