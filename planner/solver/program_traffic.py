"""What one step's messages put on the links (``planner.solver.program_cost``): wire time and messages per directed
device pair, the boundary directions each carries, the checks each device hosts, the copies into verifiers, and
the verdict wait a consumer's own pass does not hide."""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm
from planner.solver.problem import Problem
from planner.solver.routing import pair_counts
from planner.solver.solution import VerifierPlacement


@dataclass(slots=True)
class _Traffic:
    """What the messages of one step put on the links: wire time per directed device pair, the boundary
    directions each pair carries, and per boundary the verdict wait a consumer's own pass does not hide."""

    wire: dict[tuple[str, str], float]
    by_direction: dict[tuple[int, str, str, str], float]  # (boundary, act|grad, src, dst) -> its wire time
    kinds: dict[tuple[str, str], set[tuple[int, str]]]
    checks: dict[str, set[tuple[int, str]]]
    wait: dict[tuple[int, str, str], float]  # (boundary, act|grad, consumer) -> ms
    messages: dict[tuple[str, str], int]  # messages per directed device pair
    copied_in: dict[tuple[int, int], set[tuple[str, str]]]  # (stage, replica) -> links copying its checked inputs


def _traffic(problem: Problem, stages, verifiers) -> _Traffic:
    out = _Traffic(wire={}, by_direction={}, kinds={}, checks={}, wait={}, messages={}, copied_in={})

    def checker(k: int, direction: str, sender: str) -> VerifierPlacement | None:
        """The verifier of ``sender``'s tensors at boundary ``k`` (a boundary's verifiers may split its senders)."""
        return next((v for v in verifiers if v.boundary == k and direction in v.directions and v.covers(sender)),
                    None)

    def put(a: str, b: str, nbytes: float, count: int, kind: tuple[int, str]) -> float:
        if a == b:
            return 0.0
        link = problem.link(a, b)
        ms = count * 1e3 * nbytes / link.bytes_per_s
        out.wire[(a, b)] = out.wire.get((a, b), 0.0) + ms
        out.messages[(a, b)] = out.messages.get((a, b), 0) + count
        out.by_direction[(*kind, a, b)] = out.by_direction.get((*kind, a, b), 0.0) + ms
        out.kinds.setdefault((a, b), set()).add(kind)
        return comm.transfer_ms(nbytes, link)

    for k in range(len(stages) - 1):
        src, dst = stages[k], stages[k + 1]
        nbytes = problem.wire_bytes(src.last_block, src.out_codec)  # copies too: one encoded payload
        for (i, j), n in pair_counts(src.microbatches, dst.microbatches).items():
            a, b = src.devices[i], dst.devices[j]
            put(a, b, nbytes, n, (k, "act"))
            put(b, a, nbytes, n, (k, "grad"))
            for direction, sender, consumer in (("act", a, b), ("grad", b, a)):
                v = checker(k, direction, sender)
                if v is None:
                    continue
                out.checks.setdefault(v.device, set()).add((k, direction))
                if v.device == consumer:
                    continue
                copy = put(sender, v.device, nbytes, n, (k, direction)) if v.device != sender else 0.0
                if direction == "act" and v.device != sender:
                    out.copied_in.setdefault((k + 1, j), set()).add((sender, v.device))
                check = problem.verify_ms(problem.raw_bytes(src.last_block), problem.class_of(v.device))
                verdict = problem.link(v.device, consumer).latency_ms
                at = dst if direction == "act" else src
                cls = problem.class_of(consumer)
                tables = problem.tables(at.recompute)
                own = tables.range_bwd_ms(at.first_block, at.last_block, cls)
                if direction == "act":
                    own = tables.range_time_ms(at.first_block, at.last_block, cls) - own
                arrival = comm.transfer_ms(nbytes, problem.link(sender, consumer)) if sender != consumer else 0.0
                key = (k, direction, consumer)  # a consumer that checks its own input waits on no verdict
                out.wait[key] = max(out.wait.get(key, 0.0), copy + check + verdict - arrival - own)
    return out
