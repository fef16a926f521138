"""The cost of verifying one boundary tensor: shared by the solver and the simulator."""
from __future__ import annotations

from cost_models.devices import DeviceSpec
from planner.errors import InvalidInputError

# A verifier reads the received tensor and its EMA reference, computes four
# distances (mean |diff|, normalised L2, sign flips: one fused pass each; the
# sliced Wasserstein distance projects and sorts: about three passes) and
# writes the updated reference: about eight passes over the tensor's bytes,
# memory-bound, plus a fixed dispatch cost.
VERIFY_PASSES = 8
VERIFY_FIXED_MS = 0.05
VERDICT_BYTES = 16  # a flag and a score


def verify_ms(nbytes: int | float, spec: DeviceSpec) -> float:
    """Time to score one received tensor of ``nbytes`` on a verifier with ``spec``."""
    if nbytes < 0:
        raise InvalidInputError("verify size", expected="nbytes >= 0", found=str(nbytes))
    return VERIFY_FIXED_MS + 1e3 * VERIFY_PASSES * nbytes / spec.mem_bw_bytes_per_s
