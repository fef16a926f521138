"""The costs of the CP-SAT model of ``planner.solver.cpsat.model``: transfers, stage times, memory, objective.

A mixin of ``cpsat._Builder``: it reads the variables and tables of ``structure.Structure`` and what
the verification mixin sets (``vload``, ``vstate``, ``cpu_load``, ``verify_hi``), and sets ``x`` (with
``xa``/``xg`` zero until verification adds its copies), ``t``, ``T``, ``ar`` and the objective ``obj``.
"""
from __future__ import annotations

import math

import numpy as np
from ortools.sat.python import cp_model

from cost_models import comm
from planner.solver.cpsat.structure import COST_RESOLUTION
from planner.solver.objective import fluid_bottleneck_ms


class CostsMixin:
    """The costs part of ``cpsat._Builder``: times are floored integer units, memory exact bytes."""

    # --- costs ---------------------------------------------------------------
    def _transfers(self) -> None:
        """x[j]: boundary j's transfer over the link between slot j and the next stage."""
        m, K = self.m, self.K
        hi = max((int(t.max()) for t in self.xtab.values()), default=0)
        self.x = [self.ivar(hi, f"x{j}") for j in range(K - 1)]
        for j in range(K - 1):
            for c, ycj in self.yc[j].items():
                for c2, ncj in self.nc[j].items():
                    lk = self.p.links[c][c2]
                    if lk is not None:
                        m.add(self.x[j] >= self.xfer(j, lk)).only_enforce_if([ycj, ncj])
        self.xa = [0] * (K - 1)  # extra activation copies to a verifier, paid by slot j
        self.xg = [0] * (K - 1)  # extra gradient copies to a verifier, paid by the next stage

    def _times(self) -> None:
        m, K, M = self.m, self.K, self.M
        hi = int(max(self.tprefix[c][-1] for c in self.SC)) + 4 * max(
            (int(t.max()) for t in self.xtab.values()), default=0) + 10 ** 6
        hi += self.verify_hi if self.verify else 0
        self.t_hi = hi * 2
        self.t = [self.ivar(self.t_hi, f"t{k}") for k in range(K)]
        gF = self.ivar(hi, "gF")
        for j in range(K - 1):
            m.add(gF >= self.x[j] + self.xg[j]).only_enforce_if(self.last[j])
        for k in range(K):
            if k == self.F:
                comm_k = gF
            else:
                comm_k = self.x[k] + self.xa[k]
                if k > 0:
                    comm_k += self.x[k - 1] + self.xg[k - 1]
            vload = self.vload[k] if self.verify else 0
            for (c, r), lit in self.y[k].items():
                share = math.ceil(M / r)
                m.add(M * self.t[k] >= share * (self.work(k, c) + comm_k) + M * vload).only_enforce_if(lit)

    # --- memory -------------------------------------------------------------------
    def _memory(self) -> None:
        m, K, F, M, p = self.m, self.K, self.F, self.M, self.p
        for k in range(K):
            if k == 0:
                buffers = p.input_bytes + 2 * self.bytes_at(0)
            elif k == F:
                buffers = 2 * self.bytes_at(K - 2)
            else:
                buffers = 2 * self.bytes_at(k - 1) + 2 * self.bytes_at(k)
            static = self.params(k) * p.state_bytes_per_param + buffers + (self.vstate[k] if self.verify else 0)
            acts = self.acts(k)
            cap = sum(lit * p.classes[c].mem_bytes for (c, r), lit in self.y[k].items())
            if p.schedule == "gpipe":
                for (c, r), lit in self.y[k].items():
                    m.add(static + math.ceil(M / r) * acts <= p.classes[c].mem_bytes).only_enforce_if(lit)
                continue
            if k == F:  # the last stage holds one microbatch under 1F1B
                m.add(static + acts <= cap)
                continue
            for jf in range(1, min(M, K - k) + 1):
                lits = []
                shares = [lit for (c, r), lit in self.y[k].items() if math.ceil(M / r) >= jf]
                if not shares:
                    break
                if len(shares) < len(self.y[k]):
                    sg = self.bool(f"sg{k}_{jf}")
                    m.add(sg == sum(shares))
                    lits.append(sg)
                else:
                    lits.append(self.u[k])
                if k + jf - 2 >= 1:  # S - k >= jf  <=>  middle slot k + jf - 2 is used
                    lits.append(self.u[k + jf - 2])
                m.add(static + jf * acts <= cap).only_enforce_if(lits)

    # --- objective -------------------------------------------------------------------
    def _objective(self) -> None:
        m, K, M, p = self.m, self.K, self.M, self.p
        self.T = self.ivar(self.t_hi, "T")
        for k in range(K):
            m.add(self.T >= self.t[k])
        if self.verify:
            for v in self.cpu:
                m.add(self.T >= self.cpu_load[v])
        # Cut: the devices of a class can hold at most count * T of per-microbatch work.
        for c in self.SC:
            sel = []
            for k in range(K):
                if c in self.yc[k]:
                    w = self.ivar(int(self.tprefix[c][-1]), f"w{k}_{c}")
                    m.add(w >= self.work(k, c)).only_enforce_if(self.yc[k][c])
                    sel.append(w)
            m.add(p.classes[c].count * self.T >= sum(sel))
        self._time_floors()
        # Per-block bound: the slowest block's best time, replicas at the largest allowed share cut.
        per_block = max(min(self.units(p.time_ms[l, c]) * math.ceil(M / max(self.opts[c])) // M
                            for c in self.SC) for l in range(self.L))
        m.add(self.T >= per_block)
        m.add(self.T >= self.units(fluid_bottleneck_ms(p)))
        self.ar = self._allreduce()
        self.obj = sum(self.t) + (M - 1) * self.T + self.ar
        m.minimize(self.obj)

    def _time_floors(self) -> None:
        """Unconditional (LP-strong) floors on slot times: the class-enforced ones relax to nothing.

        Whatever its class and replicas, a slot takes at least the best share
        times the best class's time of each of its blocks, plus its cheapest
        sends (one for an end stage, two for a middle one).
        """
        m, p, M, K = self.m, self.p, self.M, self.K
        share = {c: math.ceil(M / max(self.opts[c])) / M for c in self.SC}
        per_block = np.min([share[c] * p.time_ms[:, c] for c in self.SC], axis=0)
        table = np.floor(np.concatenate([[0.0], np.cumsum(per_block)]) * self.U).astype(np.int64)
        h_min = min(share.values())
        send = min((int(t[:-1].min()) if len(t) > 1 else 0) for t in self.xtab.values()) if self.xtab else 0
        send = int(math.floor(h_min * send))
        for k in range(K):
            if k == self.F:
                floor = int(table[self.L]) - self.element(("amin",), k - 1, table[1:]) - 1 + send
            else:
                here = self.element(("amin",), k, table[1:])
                floor = (here if k == 0 else here - self.element(("amin",), k - 1, table[1:]) - 1)
                floor += send if k == 0 else 2 * send * self.u[k]
            m.add(self.t[k] >= floor)

    def _allreduce(self) -> cp_model.LinearExpr:
        m, p = self.m, self.p
        terms = [(k, c, r, lit) for k in range(self.K) for (c, r), lit in self.y[k].items() if r > 1]
        if not terms:
            return 0
        total_grad = int(p.param_count.sum() + sum(t.param_count for t in p.tied)) * p.ar_bytes_per_param
        ar_hi = max(self.units(comm.allreduce_ms(total_grad, (p.links[c][c],) * r, r)) + 1
                    for _, c, r, _ in terms)
        ar = self.ivar(ar_hi, "AR")
        for k, c, r, lit in terms:
            ring = (p.links[c][c],) * r
            slope_ms = comm.allreduce_ms(1e9, ring, r) - comm.allreduce_ms(0.5e9, ring, r)  # per 0.5e9 bytes
            per_param = slope_ms / 0.5e9 * p.ar_bytes_per_param * self.U
            lat_units = self.units(2 * (r - 1) * ring[0].latency_ms)
            scale = 1 << max(0, math.ceil(math.log2(1.0 / (COST_RESOLUTION * max(per_param, 1e-30))))) \
                if per_param > 0 else 1
            scale = min(scale, max(1, (1 << 60) // (ar_hi + 1)))
            slope = int(math.floor(per_param * scale)) * self.params(k)
            if int(p.param_count.min()) > 0:
                m.add(scale * ar >= slope + scale * lat_units).only_enforce_if(lit)
                continue
            # A stage without parameters all-reduces nothing (no latency either).
            has = self.bool(f"hasp{k}_{c}_{r}")
            m.add(self.params(k) <= 0).only_enforce_if(~has)
            m.add(scale * ar >= slope).only_enforce_if(lit)
            m.add(scale * ar >= slope + scale * lat_units).only_enforce_if([lit, has])
        return ar
