"""The end of a verified step as the solver prices it: the lead verifier's verdict reaching the first stage.

The same exchange as the simulator's (``cost_models.verify.verdict_exchange``), over devices: the compiled
plan numbers its ranks stage by stage, replica by replica, then the verifier-only hosts, so the lead (the
lowest verifier rank) is the verifier on the earliest stage device, else the first verifier host.
"""
from __future__ import annotations

from collections.abc import Sequence

from cost_models import comm
from cost_models.verify import VERDICT_BYTES, verdict_exchange
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement, VerifierPlacement


def with_verdict(problem: Problem, stages: Sequence[StagePlacement], verifiers: Sequence[VerifierPlacement],
                 ready: Sequence[float], step_ms: float) -> float:
    """``step_ms`` (each stage's devices done at ``ready[k]``) until the first stage's devices have heard the
    step's verdict; ``step_ms`` itself without verification."""
    if not verifiers or not problem.policy.enabled:
        return step_ms
    order = [d for st in stages for d in st.devices]
    at = {d: ready[k] for k, st in enumerate(stages) for d in st.devices}
    hosts = sorted({v.device for v in verifiers} - set(order))
    at.update({d: step_ms for d in hosts})  # a verifier host checks until the step's last gradient
    lead_first = sorted({v.device for v in verifiers}, key=lambda d: order.index(d) if d in order
                        else len(order) + hosts.index(d))
    sketches = [d for st in stages if len(st.devices) >= 2
                and not all(problem.classes[problem.class_of(d)].trusted for d in st.devices) for d in st.devices]

    def message_ms(a: str, b: str) -> float:
        return comm.transfer_ms(VERDICT_BYTES, problem.link(a, b)) if a != b else 0.0

    heard = verdict_exchange(at, verifiers=lead_first, counters=stages[0].devices, sketches=sketches,
                             message_ms=message_ms)
    return max([step_ms] + [heard[d] for d in stages[0].devices])
