"""The cost of verifying one boundary tensor: shared by the solver and the simulator."""
from __future__ import annotations

from cost_models.devices import DeviceSpec
from planner.errors import InvalidInputError

# Measured, not guessed: the runtime's check (``planner.integrity.verifier.Verifier.check``
# on four monitors of two consecutive boundaries, link tests included, one torch
# thread; its share of the step's closing) costs 1.79 / 2.41 / 3.71 / 6.61 ms at
# 0.125 / 0.5 / 1.5 / 3 MiB on the 2-core VM whose profile measured 32 GB/s: 1.50 ms
# + 1.66 ms/MiB, i.e. about 50 passes over the tensor at that bandwidth (the
# summary's moments, projections, sorted quantiles, covariance, sketch, the
# surrogate's fit and the replay ring), plus a fixed cost of ~30 small ops and
# their Python. The first guess, 8 passes + 0.05 ms, priced a gpt-tiny check
# (0.125 MiB) 20x under what it costs, and with it the verifier's load.
VERIFY_PASSES = 50
VERIFY_FIXED_MS = 1.5
VERDICT_BYTES = 16  # a flag and a score


def verify_ms(nbytes: int | float, spec: DeviceSpec) -> float:
    """Time to score one received tensor of ``nbytes`` on a verifier with ``spec``."""
    if nbytes < 0:
        raise InvalidInputError("verify size", expected="nbytes >= 0", found=str(nbytes))
    return VERIFY_FIXED_MS + 1e3 * VERIFY_PASSES * nbytes / spec.mem_bw_bytes_per_s
