"""The cost of verifying one boundary tensor: shared by the solver and the simulator."""
from __future__ import annotations

from cost_models.devices import DeviceSpec
from planner.errors import InvalidInputError

# Fitted to the runtime's check (``planner.integrity.verifier.Verifier.check``), not guessed: about
# 50 passes over the tensor at the device's memory bandwidth (the summary's moments, projections,
# sorted quantiles, covariance, sketch, the surrogate's fit and the replay ring), plus a fixed cost
# of ~30 small ops and their Python (fit and history: benchmarks/README.md).
VERIFY_PASSES = 50
VERIFY_FIXED_MS = 1.5
VERDICT_BYTES = 16  # a flag and a score


def verify_ms(nbytes: int | float, spec: DeviceSpec) -> float:
    """Time to score one received tensor of ``nbytes`` on a verifier with ``spec``."""
    if nbytes < 0:
        raise InvalidInputError("verify size", expected="nbytes >= 0", found=str(nbytes))
    return VERIFY_FIXED_MS + 1e3 * VERIFY_PASSES * nbytes / spec.mem_bw_bytes_per_s
