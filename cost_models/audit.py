"""The price of auditing a replica (``planner.integrity.audit``): a link test on a share of its microbatches.

Per audited microbatch the verifier receives a copy of the stage's input (and, to audit the gradient the
replica sends upstream, the gradient it was sent), recomputes the stage (a forward; a forward and a backward
for the gradient) and compares the result with what the replica sent (a read of both). The full link test
instead needs a verifier on the stage's input boundary for every microbatch; the audit pays for ``share`` of
them, off the replicas' critical path (the verifier works while the pipeline runs on). To recompute, the
verifier keeps a copy of the stage's weights current: each step it receives the stage's update (the replicas'
summed gradient, or the new weights: ``weight_sync_bytes``), whatever the share.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm
from cost_models.cluster import Link
from planner.errors import InvalidInputError

COMPARE_PASSES = 3   # read the sent and the recomputed tensor, write their difference


@dataclass(frozen=True, slots=True)
class AuditCost:
    """One step's audit of one replica, in milliseconds: the inputs' copies to the verifier (on the link from
    the replica's upstream sender) and the verifier's recomputes and comparisons."""

    copy_ms: float
    compute_ms: float
    sync_ms: float = 0.0   # the stage's update to the verifier's copy of its weights

    @property
    def total_ms(self) -> float:
        return self.copy_ms + self.compute_ms + self.sync_ms


def audit_ms(*, share: float, microbatches: int, input_bytes: float, output_bytes: float, forward_ms: float,
             link: Link, verifier_mem_bw_bytes_per_s: float, backward_ms: float | None = None,
             output_grad_bytes: float = 0.0, weight_sync_bytes: float = 0.0) -> AuditCost:
    """The expected audit cost a step of a replica sending ``microbatches`` a step, ``share`` of them audited.

    ``input_bytes`` / ``output_bytes``: one microbatch's stage input and output; ``forward_ms``: the stage's
    forward of one microbatch on the verifier. ``backward_ms`` (None: activations only) audits the gradient
    the replica sends upstream too, which needs the gradient it received (``output_grad_bytes``) and a
    backward; the comparison then reads the input gradient as well. ``weight_sync_bytes``: the stage's update
    sent to the verifier each step (0 where it already holds the weights, e.g. a trusted replica's host)."""
    if not 0.0 <= share <= 1.0:
        raise InvalidInputError("audit share", expected="a share in [0, 1]", found=str(share))
    if microbatches < 0:
        raise InvalidInputError("audit microbatches", expected="microbatches >= 0 a step", found=str(microbatches))
    for name, value in (("input_bytes", input_bytes), ("output_bytes", output_bytes), ("forward_ms", forward_ms),
                        ("output_grad_bytes", output_grad_bytes), ("backward_ms", backward_ms or 0.0),
                        ("weight_sync_bytes", weight_sync_bytes)):
        if value < 0:
            raise InvalidInputError(f"audit {name}", expected=">= 0", found=str(value))
    if verifier_mem_bw_bytes_per_s <= 0:
        raise InvalidInputError("verifier memory bandwidth", expected="> 0 bytes/s",
                                found=str(verifier_mem_bw_bytes_per_s))
    audited = share * microbatches
    grads = backward_ms is not None
    copied = input_bytes + (output_grad_bytes if grads else 0.0)
    compared = output_bytes + (input_bytes if grads else 0.0)
    compute = forward_ms + (backward_ms or 0.0) + 1e3 * COMPARE_PASSES * compared / verifier_mem_bw_bytes_per_s
    return AuditCost(copy_ms=audited * comm.transfer_ms(copied, link), compute_ms=audited * compute,
                     sync_ms=comm.transfer_ms(weight_sync_bytes, link) if share > 0 else 0.0)
