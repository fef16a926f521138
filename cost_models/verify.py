"""The cost of verifying one boundary tensor: shared by the solver and the simulator."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from cost_models.devices import DeviceSpec
from planner.errors import InvalidInputError

# Fitted to the runtime's check (``planner.integrity.verifier.Verifier.check``), not guessed: about
# 50 passes over the tensor at the device's memory bandwidth (the summary's moments, projections,
# sorted quantiles, covariance, sketch, the surrogate's fit and the replay ring), plus a fixed cost
# of ~30 small ops and their Python (fit and history: benchmarks/README.md).
VERIFY_PASSES = 50
VERIFY_FIXED_MS = 1.5
VERDICT_BYTES = 16  # a flag and a score
T = TypeVar("T")  # who takes part in the verdict exchange: a rank, or a device while solving


def verify_ms(nbytes: int | float, spec: DeviceSpec) -> float:
    """Time to score one received tensor of ``nbytes`` on a verifier with ``spec``."""
    if nbytes < 0:
        raise InvalidInputError("verify size", expected="nbytes >= 0", found=str(nbytes))
    return VERIFY_FIXED_MS + 1e3 * VERIFY_PASSES * nbytes / spec.mem_bw_bytes_per_s


# A verifier's end-of-step flags and blame: Python over the step's few flags, on the verifier host's CPU
# whatever its device (0.3-0.8 ms measured on the 2-core VM: gpt-tiny, two verifiers).
BLAME_MS = 0.5


def verdict_exchange(ready: Mapping[T, float], *, verifiers: Sequence[T], counters: Sequence[T],
                     sketches: Sequence[T] = (), message_ms: Callable[[T, T], float],
                     blame_ms: float = BLAME_MS) -> dict[T, float]:
    """When each participant, ready at ``ready``, hears the step's verdict (as the runtime's
    ``executor_verify._end_verification`` runs it): the replicas of watched stages (``sketches``) send their
    gradient sketches to the lead verifier (the first of ``verifiers``), the verifiers exchange their flags
    (two ring all-gathers: sizes, then the flags) and resolve blame, the first stage's ranks (``counters``)
    send the lead how many microbatches trained, and the lead sends every participant the verdict."""
    lead = verifiers[0]
    at = {v: ready[v] for v in verifiers}
    at[lead] = max([ready[lead]] + [ready[r] + message_ms(r, lead) for r in sketches if r != lead])
    flags = max(at.values())
    if len(verifiers) > 1:  # each all-gather: k - 1 steps round the ring
        flags += 2 * (len(verifiers) - 1) * max(message_ms(a, b) for a in verifiers for b in verifiers if a != b)
    decided = max([flags + blame_ms] + [ready[r] + message_ms(r, lead) for r in counters if r != lead])
    return {r: max(t, decided + (message_ms(lead, r) if r != lead else 0.0)) for r, t in ready.items()}
