"""Hinting and decoding for the CP-SAT model of ``planner.solver.cpsat.model``.

``HintMixin`` turns a known plan into hints on the model's decisions and a
solver's assignment back into a ``Placement``; ``complete_hint`` extends a
hint on the decisions to every variable, so CP-SAT starts from that plan.
"""
from __future__ import annotations

from ortools.sat.python import cp_model

from planner.solver.objective import Placement, even_split, required_directions
from planner.solver.search.budget import (
    CPSAT_DET_PER_S,
    UNITS_PER_S,
    Work,
    record_ceiling,
)
from planner.solver.solution import StagePlacement, VerifierPlacement


class HintMixin:
    """The hint and decode part of ``cpsat._Builder``."""

    def hint(self, placement: Placement) -> None:
        """Guide the search with a known plan (slots and classes; CP-SAT completes the rest)."""
        p, K, F, m = self.p, self.K, self.F, self.m
        stages = placement.stages
        S = len(stages)
        if not 2 <= S <= K:
            return
        slot_of = {i: (i if i < S - 1 else F) for i in range(S)}
        for k in range(1, K - 1):
            m.add_hint(self.u[k], k < S - 1)
        for k in range(K - 1):
            m.add_hint(self.e[k], stages[min(k, S - 2)].last_block)
        for i, st in enumerate(stages):
            k = slot_of[i]
            classes = {p.class_of(d) for d in st.devices}
            key = (classes.pop(), len(st.devices)) if len(classes) == 1 else None
            for opt, lit in self.y[k].items():
                m.add_hint(lit, opt == key)
        if not self.verify:
            return
        chosen = {v.boundary: v.device for v in placement.verifiers}
        for j, opts in enumerate(self.vopt):
            dev = chosen.get(j) if j < S - 1 else None
            pick = None
            if dev is not None:
                if stages[j + 1].devices == (dev,):
                    pick = "r"
                elif stages[j].devices == (dev,):
                    pick = "l"
                elif stages[0].devices == (dev,):
                    pick = "0"
                elif stages[-1].devices == (dev,):
                    pick = "F"
                else:
                    pick = dev
            for key, lit in opts.items():
                m.add_hint(lit, key == pick)

    def decode(self, solver: cp_model.CpSolver) -> Placement:
        p, K, F, M = self.p, self.K, self.F, self.M
        slots = [0] + [k for k in range(1, K - 1) if solver.boolean_value(self.u[k])] + [F]
        free = {c: list(p.classes[c].device_ids) for c in self.SC}
        stages, first = [], 0
        for i, k in enumerate(slots):
            last = self.L - 1 if k == F else solver.value(self.e[k])
            (c, r), = [opt for opt, lit in self.y[k].items() if solver.boolean_value(lit)]
            devices = tuple(free[c][:r])
            del free[c][:r]
            stages.append(StagePlacement(index=i, first_block=first, last_block=last, devices=devices,
                                         microbatches=even_split(M, r)))
            first = last + 1
        stages = tuple(stages)
        verifiers = []
        if self.verify:
            for j in range(len(stages) - 1):
                need = required_directions(p, stages, j)
                picked = [key for key, lit in self.vopt[j].items() if solver.boolean_value(lit)]
                if not need or not picked:
                    continue
                key = picked[0]
                site = {"r": stages[j + 1], "l": stages[j], "0": stages[0], "F": stages[-1]}.get(key)
                device = site.devices[0] if site is not None else key
                verifiers.append(VerifierPlacement(boundary=j, device=device, directions=need))
        return Placement(stages=stages, verifiers=tuple(verifiers), num_microbatches=M)


def deterministic(solver: cp_model.CpSolver, seconds: float, workers: int, seed: int, work: Work) -> None:
    """Limit ``solver`` to ``seconds`` nominal seconds of its deterministic time and make its search repeatable:
    the subsolvers interleaved in fixed batches (for given ``workers``, the same answer under any load), the seed
    given; the wall clock only as ``work``'s ceiling."""
    solver.parameters.max_deterministic_time = max(0.01, seconds * CPSAT_DET_PER_S)
    solver.parameters.max_time_in_seconds = max(0.05, work.ceiling_left_s())
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.interleave_search = True
    solver.parameters.random_seed = seed


def stopped(solver: cp_model.CpSolver, status: int, work: Work) -> None:
    """Charge ``work`` with what the solve spent (its deterministic time) and record when the wall-clock
    ceiling, not that, ended it."""
    det, limit = solver.response_proto.deterministic_time, solver.parameters.max_deterministic_time
    work.charge(min(det, limit) / CPSAT_DET_PER_S * UNITS_PER_S)  # its count sums the workers': past the limit
    proven = status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
    if not proven and solver.wall_time >= 0.99 * solver.parameters.max_time_in_seconds:
        record_ceiling(work.what)


def complete_hint(model: cp_model.CpModel, time_limit_s: float, workers: int, *, seed: int = 0,
                  within: Work | None = None) -> bool:
    """Turn a hint on the decisions into a full assignment (CP-SAT then starts from that plan).

    Solves once with the hinted variables fixed (``time_limit_s`` nominal seconds of deterministic time); on
    success every variable gets its value as hint. Returns whether it succeeded.
    """
    work = Work.of(time_limit_s, within, "CP-SAT")
    solver = cp_model.CpSolver()
    deterministic(solver, time_limit_s, workers, seed, work)
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.stop_after_first_solution = False
    status = solver.solve(model)
    stopped(solver, status, work)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False
    values = solver.response_proto.solution
    model.clear_hints()
    for i, value in enumerate(values):
        model.add_hint(model.get_int_var_from_proto_index(i), value)
    return True
