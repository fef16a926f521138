"""The greedy verifier assignment every search and baseline shares: allowed sites, cheapest first."""
from __future__ import annotations

from planner.solver.objective import Placement, evaluate, required_directions
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement, VerifierPlacement


def verifier_sites(problem: Problem, stages: tuple[StagePlacement, ...], boundary: int,
                   need: tuple[str, ...]) -> tuple[str, ...]:
    """Devices allowed to check ``boundary`` (in the solver's search space), cheapest-first order not implied.

    The devices of the boundary's two stages and of the first and the last
    stage (every replica: a replica checks its twins' microbatches too), and
    CPU verifier hosts; each trusted, outside the checked senders' trust
    domain, and allowed by the policy's placement.
    """
    S, pol = len(stages), problem.policy
    senders = (stages[boundary].devices if "act" in need else ()) + \
        (stages[boundary + 1].devices if "grad" in need else ())
    domains = {problem.classes[problem.class_of(d)].domain for d in senders} - {None}
    out: list[str] = []
    if pol.verifier_placement in ("any", "stage"):
        for k in dict.fromkeys((boundary, boundary + 1, 0, S - 1)):
            out.extend(stages[k].devices)
    if pol.verifier_placement in ("any", "cpu"):
        out.extend(d for c in problem.classes if c.verifier_host for d in c.device_ids)
    ok = []
    for d in dict.fromkeys(out):
        c = problem.classes[problem.class_of(d)]
        if c.trusted and (c.domain is None or c.domain not in domains):
            ok.append(d)
    return tuple(ok)


def _untrusted(problem: Problem, st: StagePlacement) -> bool:
    return any(not problem.classes[problem.class_of(d)].trusted for d in st.devices)


def link_windows(problem: Problem, stages: tuple[StagePlacement, ...]) -> list[tuple[int, ...]]:
    """The boundaries to verify, in runs the link test joins: an untrusted stage between two boundaries
    needs one verifier to see both (its input and its output), so consecutive such stages chain them."""
    S, windows = len(stages), []
    for b in range(S - 1):
        linked = b >= 1 and _untrusted(problem, stages[b])  # stage b sits between boundaries b-1 and b
        if linked and windows and windows[-1][-1] == b - 1:
            windows[-1] = (*windows[-1], b)
        elif required_directions(problem, stages, b) or (b + 1 <= S - 2 and _untrusted(problem, stages[b + 1])):
            windows.append((b,))
    return windows


def link_directions(problem: Problem, stages: tuple[StagePlacement, ...], boundary: int,
                    window: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(directions carried, of them watch-only) at ``boundary`` in ``window``: the checked ones, plus a
    trusted sender's tensor that is the input of an untrusted neighbour whose output is in the window."""
    need = required_directions(problem, stages, boundary)
    watch = []
    if "act" not in need and boundary + 1 in window:  # stage b+1's output act is boundary b+1's
        watch.append("act")
    if "grad" not in need and boundary - 1 in window and problem.policy.check_gradients:
        watch.append("grad")  # stage b's output gradient is boundary b-1's
    carried = tuple(d for d in ("act", "grad") if d in need or d in watch)
    return carried, tuple(watch)


def assign_verifiers(problem: Problem, stages: tuple[StagePlacement, ...], num_microbatches: int, *,
                     link: int = 1) -> tuple[VerifierPlacement, ...] | None:
    """Greedy: each checked boundary, in order, takes the site that raises the step time least.

    ``link`` > 1: each run of :func:`link_windows`, cut into pieces of at most ``link`` boundaries (and the
    per-verifier cap), goes a piece at a time to one site allowed at all its boundaries, with the trusted
    copies the link tests need, so the untrusted stages inside a piece get the link and residual tests; a
    piece with no common site falls back to a boundary at a time. Returns None when some boundary has no
    allowed site left.
    """
    base = evaluate(problem, Placement(stages=stages, verifiers=(), num_microbatches=num_microbatches))
    state = _Greedy(problem, stages, num_microbatches, list(base.stage_ms))
    size = min(link, problem.policy.max_boundaries_per_verifier or link)
    windows = link_windows(problem, stages) if size > 1 else \
        [(b,) for b in range(len(stages) - 1) if required_directions(problem, stages, b)]
    for window in windows:
        chunks = [window[i:i + size] for i in range(0, len(window), size)]
        for chunk in chunks:
            if len(chunk) > 1 and state.place(chunk, linked=True):
                continue
            for b in chunk:
                if required_directions(problem, stages, b) and not state.place((b,), linked=False):
                    return None
    return tuple(state.chosen)


class _Greedy:
    """The running state of :func:`assign_verifiers`: stage times, verifier loads, the choices so far."""

    def __init__(self, problem: Problem, stages: tuple[StagePlacement, ...], M: int, stage_ms: list[float]):
        self.p, self.stages, self.M, self.t = problem, stages, M, stage_ms
        self.stage_of = {d: k for k, st in enumerate(stages) for d in st.devices}
        self.load: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.chosen: list[VerifierPlacement] = []

    def place(self, chunk: tuple[int, ...], *, linked: bool) -> bool:
        """Put ``chunk``'s boundaries on the one site (allowed at each, within the cap) that raises the
        step time least; False when there is none."""
        p, stages = self.p, self.stages
        dirs = {b: link_directions(p, stages, b, chunk) if linked else (required_directions(p, stages, b), ())
                for b in chunk}
        sites = None
        for b in chunk:
            allowed = verifier_sites(p, stages, b, required_directions(p, stages, b))
            sites = allowed if sites is None else tuple(v for v in sites if v in allowed)
        prev = self.chosen[-1].device if self.chosen and self.chosen[-1].boundary == chunk[0] - 1 else None
        if prev in sites:  # on a tie keep the previous boundary's verifier: its link test sees both sides
            sites = (prev, *(v for v in sites if v != prev))
        cap = p.policy.max_boundaries_per_verifier
        best: tuple[float, str, dict[int, float], float] | None = None
        for v in sites:
            if cap is not None and self.count.get(v, 0) + len(chunk) > cap:
                continue
            add, vcost = self._cost(v, chunk, dirs)
            new_load = self.load.get(v, 0.0) + (vcost if v not in self.stage_of else 0.0)
            new_t = {k: self.t[k] + dt for k, dt in add.items()}
            peak = max([max(self.t)] + list(new_t.values()) + [new_load] + list(self.load.values()))
            score = sum(add.values()) + (self.M - 1) * peak
            if best is None or score < best[0] - 1e-12:
                best = (score, v, new_t, new_load)
        if best is None:
            return False
        _, v, new_t, new_load = best
        for k, val in new_t.items():
            self.t[k] = val
        if v not in self.stage_of:
            self.load[v] = new_load
        self.count[v] = self.count.get(v, 0) + len(chunk)
        self.chosen.extend(VerifierPlacement(boundary=b, device=v, directions=dirs[b][0], watch_only=dirs[b][1])
                           for b in chunk if dirs[b][0])
        return True

    def _cost(self, v: str, chunk: tuple[int, ...],
              dirs: dict[int, tuple[tuple[str, ...], tuple[str, ...]]]) -> tuple[dict[int, float], float]:
        """(added ms per stage, the verifier's own added ms) of checking ``chunk`` on ``v``."""
        p, stages, M = self.p, self.stages, self.M
        add: dict[int, float] = {}
        vcost = 0.0
        for b in chunk:
            carried = dirs[b][0]
            nbytes = p.wire_bytes(stages[b].last_block, stages[b].out_codec)  # copies travel encoded
            vcost += len(carried) * p.verify_ms(p.raw_bytes(stages[b].last_block), p.class_of(v))
            for direction, src, dst in (("act", b, b + 1), ("grad", b + 1, b)):
                if direction in carried and stages[dst].devices != (v,):
                    for dev, m in zip(stages[src].devices, stages[src].microbatches):
                        if dev != v:
                            add[src] = add.get(src, 0.0) + m / M * p.transfer_ms(nbytes, dev, v)
        if v in self.stage_of:
            add[self.stage_of[v]] = add.get(self.stage_of[v], 0.0) + vcost
        return add, vcost
