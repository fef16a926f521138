"""Calibrate the work budget's ``dp_units`` and grid charges (``planner.solver.search.budget``) on real solves.

Each case is planned with ``planner.api.plan_chain`` at a short time limit while every sequence DP
(``SequenceDP.run``), every Lagrangian bound search (``LagrangeBound.run``: its DPs, cutting-plane LPs and box
logic, the relaxed plans' pricing left out: that is charged on its own) and every uniform grid (``grid._grid``)
is timed in CPU time of its thread (``time.thread_time``: the solver's other threads left out). Per case and in
all: measured / charged (median, 10th and 90th percentile, totals) of

* ``dp``: each sequence DP against ``dp_units`` of its own sizes (L blocks, C classes, R replica options, J layers);
* ``bound``: each bound search's CPU per charged DP against the ``dp_units`` it charged (the full DP's sizes: a
  LazyDP's looser tries and the LPs included, so this is the charge's real cost);
* ``grid``: each grid tried against what it charged (``grid_try_units``, ``grid_check_units``: how far it went).

Cases: the 1000-block x 176-device pool of ``benchmarks/warm_replan.py`` (30 s, as measured there), smaller
tiered pools of that family, the random wide-area pools of ``tests/unit/test_one_cost.py``, SENTINEL-,
HexiScale- and DT-FM-like pools (``benchmarks/pools.py``) and the Sailor-like and consumer-40 cluster files.

Run: ``python benchmarks/calibrate_units.py [--quick] [--only NAME ...]``; writes
``benchmarks/results/calibrate_units.json`` (``--quick``: the small cases at 1 s, nothing written).
``benchmarks/results/calibrate_units_fit.json``: the records ``dp_units`` was fitted on (solves under the charges
before it). ``--refit FILE``: the table again from a results file's records under the current functions (grids: totals only,
against what they charged as run; a file from before the grid charges were fitted has none).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.solver.search import budget

RESULTS = ROOT / "benchmarks" / "results" / "calibrate_units.json"
CLUSTERS = ROOT / "benchmarks" / "clusters"


class Recorder:
    """The timings, appended from every thread (per-thread accumulators for the nested ones)."""

    def __init__(self) -> None:
        self.case = ""
        self.dp: list[list] = []      # case, L, C, R, J, lump, exact_cap, us
        self.bound: list[list] = []   # case, L, C, R, J, charges, us (DPs + LPs + boxes, pricing left out)
        self.grid: list[list] = []    # case, L, D, pp, dp, M, found, us, charged units
        self._inner: dict[int, float] = {}

    def inner(self) -> float:
        return self._inner.get(threading.get_ident(), 0.0)

    def add_inner(self, us: float) -> None:
        key = threading.get_ident()
        self._inner[key] = self._inner.get(key, 0.0) + us


def install(rec: Recorder) -> None:
    """Wrap the timed functions (module attributes the callers look up at call time)."""
    from planner.solver.bound import lagrange, sequence_dp
    from planner.solver.search import grid, relaxed_plans

    run0 = sequence_dp.SequenceDP.run

    def run(self, cap_ms, lam, ar_cap_ms=float("inf")):
        t = time.thread_time()
        try:
            return run0(self, cap_ms, lam, ar_cap_ms)
        finally:
            rec.dp.append([rec.case, self.L, self.C, self.R, self.J, bool(self.lump), bool(self.exact_cap),
                           (time.thread_time() - t) * 1e6])
    sequence_dp.SequenceDP.run = run

    consider0 = relaxed_plans.RelaxedPlans.consider

    def consider(self, relaxed):  # the relaxed plans' pricing: charged on its own, so left out of the bound's
        t = time.thread_time()
        try:
            return consider0(self, relaxed)
        finally:
            rec.add_inner((time.thread_time() - t) * 1e6)
    relaxed_plans.RelaxedPlans.consider = consider

    late0 = lagrange.LagrangeBound._bisect_late

    def late(self):
        self._charges = getattr(self, "_charges", 0) + 1
        return late0(self)
    lagrange.LagrangeBound._bisect_late = late

    bound0 = lagrange.LagrangeBound.run

    def bound_run(self):
        t, inner = time.thread_time(), rec.inner()
        try:
            return bound0(self)
        finally:
            us = (time.thread_time() - t) * 1e6 - (rec.inner() - inner)
            b = self.full_dp
            rec.bound.append([rec.case, b.L, b.C, b.R, b.J, self.dps + getattr(self, "_charges", 0), us])
    lagrange.LagrangeBound.run = bound_run

    grid0 = grid._grid

    def timed_grid(problem, pp, dp, **kw):
        work = kw.get("work")
        spent0, t = getattr(work, "spent", 0.0), time.thread_time()
        found = None
        try:
            return (found := grid0(problem, pp, dp, **kw))
        finally:
            us, charged = (time.thread_time() - t) * 1e6, getattr(work, "spent", 0.0) - spent0
            if work is not None:   # a grid tried outside a budget charges nothing: nothing to compare
                D = sum(c.count for c in problem.classes if c.stage_capable)
                rec.grid.append([rec.case, problem.num_blocks, D, pp, dp, problem.num_microbatches,
                                 found is not None, us, charged])
    grid._grid = timed_grid


def _tiered(blocks: int, devices: int):
    from benchmarks.warm_replan import _case
    return _case(blocks, devices)


def cases(quick: bool) -> list[tuple[str, object]]:
    """(name, thunk planning it): each thunk builds its chain and cluster and calls ``plan_chain``."""
    from cost_models.cluster_file import load_cluster
    from planner.api import plan_chain
    from planner.solver.policy import VerificationPolicy

    def tiered(blocks, devices, limit):
        def go():
            chain, cluster = _tiered(blocks, devices)
            plan_chain(chain, cluster, spec="bench:chain", global_batch=32, policy=VerificationPolicy(),
                       time_limit_s=limit)
        return go

    def one_cost(seed, limit):
        def go():
            from tests.unit.program_fixtures import POLICY
            from tests.unit.test_one_cost import _case
            chain, cluster, batch = _case(seed)
            plan_chain(chain, cluster, spec="tests:chain", global_batch=batch, microbatch_size=1, policy=POLICY,
                       time_limit_s=limit, workers=1)
        return go

    def named(cluster_fn, model, seq, batch, dtype, limit):
        def go():
            from planner.model_io import load_chain
            _, chain = load_chain(model, batch=1, seq=seq)
            plan_chain(chain, cluster_fn(), spec=model, seq=seq, global_batch=batch, dtype=dtype, time_limit_s=limit,
                       workers=2)
        return go

    from benchmarks.pools import hexiscale, sentinel
    if quick:
        return [("one-cost-0", one_cost(0, 1.0)), ("tiered-48x40", tiered(48, 40, 1.0))]
    return [
        ("tiered-1000x176", tiered(1000, 176, 30.0)),
        ("tiered-250x88", tiered(250, 88, 4.0)),
        ("tiered-96x40", tiered(96, 40, 3.0)),
        *((f"one-cost-{s}", one_cost(s, 2.0)) for s in range(6)),
        ("sentinel-1g-v1", named(lambda: sentinel(1.0, 1), "gpt-1.3b", 1024, 64, "auto", 5.0)),
        ("hexiscale", named(hexiscale, "llama-7b", 2048, 64, "bf16", 5.0)),
        ("dtfm-worldwide", named(lambda: load_cluster(CLUSTERS / "dtfm-worldwide.yaml"), "gpt-1.3b", 1024, 64,
                                 "auto", 5.0)),
        ("sailor-like", named(lambda: load_cluster(CLUSTERS / "sailor-like.yaml"), "gpt-1.3b", 1024, 64, "auto",
                              5.0)),
        ("consumer-40", named(lambda: load_cluster(CLUSTERS / "consumer-40.yaml"), "gpt-1.3b", 1024, 64, "auto",
                              5.0)),
    ]


def _stats(measured: np.ndarray, charged: np.ndarray) -> dict:
    r = measured / charged
    return {"n": len(r), "median": round(float(np.median(r)), 3), "p10": round(float(np.percentile(r, 10)), 3),
            "p90": round(float(np.percentile(r, 90)), 3),
            "total": round(float(measured.sum() / charged.sum()), 3),
            "measured_s": round(float(measured.sum()) / 1e6, 3), "charged_s": round(float(charged.sum()) / 1e6, 3)}


def table(records: dict) -> dict:
    """measured / charged per case and in all, under the functions ``budget`` holds now."""
    out: dict[str, dict] = {}
    dp = records["dp"]
    if dp:
        meas = np.array([r[7] for r in dp])
        chg = np.array([budget.dp_units(r[1], r[2], r[3], r[4]) for r in dp])
        out["dp"] = _by_case([r[0] for r in dp], meas, chg)
    bd = [r for r in records["bound"] if r[5] > 0]
    if bd:
        meas = np.array([r[6] / r[5] for r in bd])
        chg = np.array([budget.dp_units(r[1], r[2], r[3], r[4]) for r in bd])
        w = np.array([r[5] for r in bd])
        out["bound"] = _by_case([r[0] for r in bd], meas * w, chg * w, per=meas / chg)
    gr = [r for r in records.get("grid", ()) if r[8] > 0]
    if gr:
        out["grid"] = _by_case([r[0] for r in gr], np.array([r[7] for r in gr]), np.array([r[8] for r in gr]))
    elif rows := [r for r in records.get("grid_sums", ()) if len(r) > 6]:   # a results file's: totals only (its
        out["grid"] = _by_case([r[0] for r in rows], np.array([r[5] for r in rows]),   # table holds the percentiles)
                               np.array([r[6] for r in rows]), totals_only=True)
    return out


def grid_sums(grid: list[list]) -> list[list]:
    """The grids' records summed per case, size and outcome (out of reach at once, rejected, valid): case, L, D,
    outcome, count, CPU us, charged units (the file keeps these, not every grid)."""
    sums: dict[tuple, list] = {}
    for case, L, D, pp, dp, M, found, us, charged in grid:
        outcome = "valid" if found else "out of reach" if pp > L or dp > M else "rejected"
        row = sums.setdefault((case, L, D, outcome), [case, L, D, outcome, 0, 0.0, 0.0])
        row[4] += 1
        row[5] += us
        row[6] += charged
    return list(sums.values())


def _by_case(names: list[str], measured: np.ndarray, charged: np.ndarray, per: np.ndarray | None = None,
             totals_only: bool = False) -> dict:
    """Stats per case and in all; ``per``: the ratios to take percentiles of (a bound's: one per search);
    ``totals_only``: summed rows, whose percentiles mean nothing (nan)."""
    names_a = np.array(names)
    rows = {}
    for name in [*dict.fromkeys(names), "all"]:
        m = np.ones(len(names), bool) if name == "all" else names_a == name
        s = _stats(measured[m], charged[m])
        if per is not None:
            s.update(n=int(m.sum()), median=round(float(np.median(per[m])), 3),
                     p10=round(float(np.percentile(per[m], 10)), 3), p90=round(float(np.percentile(per[m], 90)), 3))
        if totals_only:
            s.update(n=int(m.sum()), median=float("nan"), p10=float("nan"), p90=float("nan"))
        rows[name] = s
    return rows


def _print(tab: dict) -> None:
    for what, rows in tab.items():
        print(f"\n{what}: measured / charged")
        print(f"{'case':>18} {'n':>7} {'median':>7} {'p10':>6} {'p90':>6} {'total':>6} {'CPU s':>8} {'charged s':>9}")
        for name, s in rows.items():
            print(f"{name:>18} {s['n']:7d} {s['median']:7.2f} {s['p10']:6.2f} {s['p90']:6.2f} {s['total']:6.2f} "
                  f"{s['measured_s']:8.2f} {s['charged_s']:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small cases at 1 s, nothing written")
    ap.add_argument("--only", nargs="*", help="case names to run")
    ap.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/results/...)")
    ap.add_argument("--refit", type=Path, default=None, help="print the table of a results file's records")
    args = ap.parse_args()
    if args.refit:
        _print(table(json.loads(args.refit.read_text())["records"]))
        return
    rec = Recorder()
    install(rec)
    from planner.solver.bound.sequence_dp_kernel import warm
    warm()
    for name, go in cases(args.quick):
        if args.only and name not in args.only:
            continue
        rec.case = name
        t = time.process_time()
        go()
        print(f"{name}: {time.process_time() - t:.1f} s CPU, {sum(r[0] == name for r in rec.dp)} DPs, "
              f"{sum(r[0] == name for r in rec.grid)} grids", flush=True)
    records = {"dp": rec.dp, "bound": rec.bound, "grid": rec.grid}
    tab = table(records)
    _print(tab)
    if not args.quick:
        out = args.out or RESULTS
        out.write_text(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                                   "units_per_s": budget.UNITS_PER_S, "table": tab, "records": {"dp": rec.dp, "bound": rec.bound, "grid_sums": grid_sums(rec.grid)}}) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
