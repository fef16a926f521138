"""Verifier placement in the CP-SAT model of ``planner.solver.cpsat.model``.

Where each checked boundary's verifier sits (either end stage, the first or
last stage, or a CPU verifier host), the load and state it adds to that site,
the extra activation/gradient copies it costs, and the per-verifier cap. A
mixin of ``cpsat._Builder``: it reads the builder's slot, class and table
variables and sets ``vopt``, ``vload``, ``vstate``, ``xa``/``xg``,
``cpu_load``/``cpu_state`` and ``verify_hi``.
"""
from __future__ import annotations

import numpy as np
from ortools.sat.python import cp_model

from planner.solver.problem import VERIFIER_STATE_COPIES


class VerificationMixin:
    """The verification part of ``cpsat._Builder`` (built only when the policy checks untrusted stages)."""

    def _vv(self, j: int, c: int) -> cp_model.IntVar:
        """Floored verify time of boundary j's tensor on class c."""
        p = self.p
        key = ("vv", c)
        tab = self._vv_tabs.get(c)
        if tab is None:
            tab = np.array([self.units(p.verify_ms(p.raw_bytes(e), c)) for e in range(self.L)])
            self._vv_tabs[c] = tab
        return self.element(key, j, tab)

    def _verification(self) -> None:
        m, K, F, p = self.m, self.K, self.F, self.p
        pol = p.policy
        self._vv_tabs: dict[int, np.ndarray] = {}
        trusted = {c for c in self.SC if p.classes[c].trusted}
        untrusted = set(self.SC) - trusted
        cls = p.classes
        bmax = int(self.bint.max())
        vhi = self.units(max(p.verify_ms(float(p.out_bytes.max()), c.index) for c in cls)) * 2 * K + 1
        self.verify_hi = vhi
        xhi = max((int(t.max()) for t in self.xtab.values()), default=0)
        self.vload = [0] * K
        self.vstate = [0] * K
        cpu_load = {v: 0 for v in self.cpu}
        cpu_state = {v: 0 for v in self.cpu}
        self.vopt: list[dict[object, cp_model.IntVar]] = []

        def clash(a: int, b: int) -> bool:
            da, db = cls[a].domain, cls[b].domain
            return da is not None and da == db

        def add_load(k: int, name: str, lits: list, coef_var: cp_model.LinearExpr, both=None) -> None:
            v = self.ivar(vhi, name)
            m.add(v >= coef_var).only_enforce_if(lits)
            if both is not None:
                m.add(v >= 2 * coef_var).only_enforce_if(lits + [both])
            self.vload[k] = self.vload[k] + v

        def add_state(k: int, name: str, lits: list, nbytes: cp_model.IntVar, both=None) -> None:
            v = self.ivar(4 * VERIFIER_STATE_COPIES * bmax, name)
            m.add(v >= VERIFIER_STATE_COPIES * nbytes).only_enforce_if(lits)
            if both is not None:
                m.add(v >= 2 * VERIFIER_STATE_COPIES * nbytes).only_enforce_if(lits + [both])
            self.vstate[k] = self.vstate[k] + v

        for j in range(K - 1):
            yj, ncj = self.yc[j], self.nc[j]
            na = self.bool(f"na{j}")
            m.add(na == sum(v for c, v in yj.items() if c in untrusted))
            ng = self.bool(f"ng{j}")
            m.add(ng == (sum(v for c, v in ncj.items() if c in untrusted) if pol.check_gradients else 0))
            need = self.bool(f"need{j}")
            m.add_max_equality(need, [na, ng])
            both = self.bool(f"both{j}")
            m.add_multiplication_equality(both, [na, ng])
            opts: dict[object, cp_model.IntVar] = {}
            if self.stage_sites:
                opts["r"] = self.bool(f"vr{j}")
                opts["l"] = self.bool(f"vl{j}")
                if j >= 1:
                    opts["0"] = self.bool(f"v0_{j}")
                if j + 1 < F:
                    opts["F"] = self.bool(f"vF{j}")
            for v in self.cpu:
                opts[v] = self.bool(f"vc{j}_{v}")
            m.add(sum(opts.values()) == need)
            self.vopt.append(opts)
            tr_next = sum(v for c, v in ncj.items() if c in trusted)
            if "r" in opts:  # the receiving stage checks the activation
                vr = opts["r"]
                m.add(tr_next >= vr)
                if j + 1 < F:
                    m.add(vr + self.u[j + 1] - 1 <= self.r1[j + 1])
                m.add(vr + self.last[j] - 1 <= self.r1[F])
                for c, a in yj.items():
                    for c2, b in ncj.items():
                        if c in untrusted and clash(c, c2):
                            m.add_bool_or([~vr, ~a, ~b])
                for c in trusted:
                    if j + 1 < F and c in self.yc[j + 1]:
                        add_load(j + 1, f"qr{j}_{c}", [vr, self.yc[j + 1][c]], self._vv(j, c))
                    if c in self.yc[F]:
                        add_load(F, f"qrF{j}_{c}", [vr, self.last[j], self.yc[F][c]], self._vv(j, c))
                if j + 1 < F:
                    add_state(j + 1, f"sr{j}", [vr, self.u[j + 1]], self.bytes_at(j))
                add_state(F, f"srF{j}", [vr, self.last[j]], self.bytes_at(j))
            if "l" in opts:  # the sending stage checks the gradient coming back
                vl = opts["l"]
                m.add(sum(v for c, v in yj.items() if c in trusted) >= vl)
                m.add(self.r1[j] >= vl)
                for c, a in yj.items():
                    for c2, b in ncj.items():
                        if c2 in untrusted and clash(c, c2):
                            m.add_bool_or([~vl, ~a, ~b])
                for c in trusted:
                    if c in yj:
                        add_load(j, f"ql{j}_{c}", [vl, yj[c]], self._vv(j, c))
                add_state(j, f"sl{j}", [vl], self.bytes_at(j))
            xa = self.ivar(xhi, f"xa{j}")
            xg = self.ivar(xhi, f"xg{j}")
            self.xa[j], self.xg[j] = xa, xg
            for key, site in (("0", 0), ("F", F)):
                if key not in opts:
                    continue
                o = opts[key]
                m.add(self.r1[site] >= o)
                m.add(sum(v for c, v in self.yc[site].items() if c in trusted) >= o)
                if key == "F":
                    m.add(self.u[j + 1] >= o)
                for cs, ys in self.yc[site].items():
                    if cs not in trusted:
                        continue
                    add_load(site, f"q{key}{j}_{cs}", [o, ys], self._vv(j, cs), both)
                    for c, a in yj.items():
                        if c in untrusted:
                            if clash(c, cs):
                                m.add_bool_or([~o, ~a, ~ys])
                            lk = p.links[c][cs]
                            if lk is not None:
                                m.add(xa >= self.xfer(j, lk)).only_enforce_if([o, a, ys])
                    for c2, b in ncj.items():
                        if c2 in untrusted and pol.check_gradients:
                            if clash(c2, cs):
                                m.add_bool_or([~o, ~b, ~ys])
                            lk = p.links[c2][cs]
                            if lk is not None:
                                m.add(xg >= self.xfer(j, lk)).only_enforce_if([o, b, ys])
                add_state(site, f"s{key}{j}", [o], self.bytes_at(j), both)
            for v in self.cpu:
                o, cv = opts[v], p.class_of(v)
                for c, a in yj.items():
                    if c in untrusted:
                        if clash(c, cv):
                            m.add_bool_or([~o, ~a])
                        m.add(xa >= self.xfer(j, p.links[c][cv])).only_enforce_if([o, a])
                for c2, b in ncj.items():
                    if c2 in untrusted and pol.check_gradients:
                        if clash(c2, cv):
                            m.add_bool_or([~o, ~b])
                        m.add(xg >= self.xfer(j, p.links[c2][cv])).only_enforce_if([o, b])
                q = self.ivar(vhi, f"qc{j}_{v}")
                m.add(q >= self._vv(j, cv)).only_enforce_if(o)
                m.add(q >= 2 * self._vv(j, cv)).only_enforce_if([o, both])
                cpu_load[v] = cpu_load[v] + q
                s = self.ivar(4 * VERIFIER_STATE_COPIES * bmax, f"sc{j}_{v}")
                m.add(s >= VERIFIER_STATE_COPIES * self.bytes_at(j)).only_enforce_if(o)
                m.add(s >= 2 * VERIFIER_STATE_COPIES * self.bytes_at(j)).only_enforce_if([o, both])
                cpu_state[v] = cpu_state[v] + s
        self.cpu_load, self.cpu_state = cpu_load, cpu_state
        for v in self.cpu:
            m.add(cpu_state[v] <= p.classes[p.class_of(v)].mem_bytes)
        self._verifier_caps()

    def _verifier_caps(self) -> None:
        cap = self.p.policy.max_boundaries_per_verifier
        if cap is None:
            return
        m, K, F = self.m, self.K, self.F
        per_slot: list[cp_model.LinearExpr] = [0] * K
        for j, opts in enumerate(self.vopt):
            if "l" in opts:
                per_slot[j] += opts["l"]
            if "r" in opts:
                if j + 1 < F:
                    a = self.bool(f"rmid{j}")
                    m.add(a >= opts["r"] + self.u[j + 1] - 1)
                    per_slot[j + 1] += a
                b = self.bool(f"rlast{j}")
                m.add(b >= opts["r"] + self.last[j] - 1)
                per_slot[F] += b
            if "0" in opts:
                per_slot[0] += opts["0"]
            if "F" in opts:
                per_slot[F] += opts["F"]
        for k in range(K):
            m.add(per_slot[k] <= cap)
        for v in self.cpu:
            m.add(sum(opts[v] for opts in self.vopt) <= cap)
