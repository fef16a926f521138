"""What the runtime's audits cost a step (issue 37; ``planner.runtime.rank.audits``).

``stagewise run`` (gloo, one process per rank, one thread each) of a 3-stage GPT whose middle stage runs on an
untrusted host, its verifiers split (rank 0 checks boundary 0, rank 2 boundary 1), so no verifier holds the
middle stage's input: rank 2 audits it from the inputs rank 0 copies it at each step's end (audits from copies).
The same plan runs with ``--audit-every`` 4 and 16 (the planner picks one in 4, 8 or 16 within ``plan
--audit-cost``) and 0 (verification on in all), interleaved so the machine's load drifts into each alike; per model, the median over runs of each run's median step (wall, the
first 3 steps warm-up) and of its CPU time summed over ranks. Models: gpt-tiny (d=64) and the d=384 and d=768
GPTs of ``verification.py``'s overhead section. Goal: <= 5% at d >= 384.

``--plan signed``: a 4-stage GPT whose stages 1 and 2 run on untrusted hosts (rank 0 checks boundary 0, rank 3
boundaries 1 and 2): rank 3 audits stage 1 from rank 0's copies and stage 2 from signed inputs (rank 1 signs every
activation it sends rank 2, rank 2 checks each and forwards the audited ones, ``audit_signed``); against the
same plan without audits (and so without signatures). Rows in the result's ``signed_rows``.

    python benchmarks/audit_overhead.py                  # writes benchmarks/results/audit_overhead.json
    python benchmarks/audit_overhead.py --quick          # one audited gpt-tiny run, 5 steps: writes nothing
    python benchmarks/audit_overhead.py --plan signed    # the 4-stage plan: writes signed_rows
    python benchmarks/audit_overhead.py --steps 16 --every 4 16 1000   # longer runs; 1 in 1000: the sync alone
    python benchmarks/audit_overhead.py --steps 14 --against /tmp/before   # before/after: see below

``--against TREE``: a source tree of the code to compare with (``git archive <commit> | tar -x -C TREE``): each
audited run is followed (or, every other rep, preceded) by the same run on that tree's code (its own process,
``PYTHONPATH=TREE``), so the machine's load drifts into both alike; the rows gain ``step_ms_before`` and
``overhead_before`` (against the same runs without audits, on this tree).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.verification import OVERHEAD_MODELS, allowed_model, overhead_plan

RESULTS = ROOT / "benchmarks" / "results" / "audit_overhead.json"
EVERIES = (4, 16)
GOAL = 0.05
PLANS = {"copies": (3, frozenset({1})), "signed": (4, frozenset({1, 2}))}   # depth, untrusted stages


def _run(path: Path, spec: str, steps: int, every: int) -> dict[str, float]:
    from planner.runtime.launcher.launch import launch
    from planner.runtime.options import RunOptions

    result = launch(RunOptions(plan=str(path), steps=steps, timeout_s=600, audit_every=every,
                               model=allowed_model(spec)))
    warm = min(3, steps - 1)
    audits = [r["verification"].get("audits") or {} for r in result["ranks"] if r.get("verification")]
    return {"ms": statistics.median(result["step_ms"][warm:]), "cpu": statistics.median(result["cpu_ms"][warm:]),
            "audits": sum(a.get("run", 0) for a in audits), "failed": sum(a.get("failed", 0) for a in audits)}


_ELSEWHERE = ("import json, sys; from pathlib import Path; from benchmarks.audit_overhead import _run; "
              "print('RESULT ' + json.dumps(_run(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))")


def _run_on(tree: Path, path: Path, spec: str, steps: int, every: int) -> dict[str, float]:
    """``_run`` on another source tree's code (``--against``), in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-P", "-c", _ELSEWHERE, str(path), spec, str(steps), str(every)],
                          env=env, cwd=tree, capture_output=True, text=True, timeout=1200, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"--against {tree}: the run failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def measure(models: dict[str, tuple[str, int | None, int]], reps: int,
            everies: tuple[int, ...] = EVERIES, *, baseline: bool = True, plan: str = "copies",
            against: Path | None = None, done_model: Any = None) -> list[dict[str, Any]]:
    """Per model and ``--audit-every`` value, the step with audits against without (``baseline`` False: the
    audited runs alone, no overhead: a smoke run); ``against``: each audited run also on that tree's code;
    ``done_model``: called with the rows so far as each model is done (a long run keeps what it measured)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (spec, seq, steps) in models.items():
            depth, untrusted = PLANS[plan]
            path = overhead_plan(spec, Path(tmp), host=False, seq=seq, depth=depth, untrusted=untrusted, split=True)
            runs: dict[int, list[dict[str, float]]] = {e: [] for e in ((0,) if baseline else ()) + everies}
            before: dict[int, list[dict[str, float]]] = {e: [] for e in everies}
            for rep in range(reps):
                for every, done in runs.items():
                    if against is None or every == 0:
                        done.append(_run(path, spec, steps, every))
                        continue
                    for here in (True, False) if rep % 2 == 0 else (False, True):
                        if here:
                            done.append(_run(path, spec, steps, every))
                        else:
                            before[every].append(_run_on(against, path, spec, steps, every))
            ms = {e: statistics.median(r["ms"] for r in runs[e]) for e in runs}
            cpu = {e: statistics.median(r["cpu"] for r in runs[e]) for e in runs}
            if not baseline:
                ms[0], cpu[0] = ms[everies[0]], cpu[everies[0]]   # no baseline: an overhead of 0 by construction
            for every in everies:
                row = {"model": name, "steps": steps, "runs": reps, "audit_every": every,
                       "step_ms_audits": round(ms[every], 1), "step_ms_no_audits": round(ms[0], 1),
                       "overhead": round(ms[every] / ms[0] - 1.0, 4), "cpu_ms_audits": round(cpu[every], 1),
                       "cpu_ms_no_audits": round(cpu[0], 1), "cpu_overhead": round(cpu[every] / cpu[0] - 1.0, 4),
                       "audits_run": sum(r["audits"] for r in runs[every]),
                       "audits_failed": sum(r["failed"] for r in runs[every])}
                if before[every]:
                    was = statistics.median(r["ms"] for r in before[every])
                    row.update(step_ms_before=round(was, 1), overhead_before=round(was / ms[0] - 1.0, 4),
                               cpu_ms_before=round(statistics.median(r["cpu"] for r in before[every]), 1),
                               audits_run_before=sum(r["audits"] for r in before[every]))
                rows.append(row)
                none = (f"none {row['step_ms_no_audits']:8.1f} ms  {row['overhead']:+.1%} wall  "
                        f"{row['cpu_overhead']:+.1%} CPU" if baseline else "(no run without audits: --quick)")
                was = f"  before {row['step_ms_before']:8.1f} ms {row['overhead_before']:+.1%}" if before[every] else ""
                print(f"{name:10s} 1 in {every:2d}: audits {row['step_ms_audits']:8.1f} ms  {none}{was}  "
                      f"({row['audits_run']} audits, {row['audits_failed']} failed)", flush=True)
            if done_model is not None:
                done_model(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(OVERHEAD_MODELS), default=list(OVERHEAD_MODELS))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--every", type=int, nargs="+", default=list(EVERIES), help="--audit-every values timed")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps a run (default the model's: 8 at d=384, 6 at d=768; the first 3 warm up)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plan", choices=list(PLANS), default="copies", help="the audited plan (see above)")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS.relative_to(ROOT)} (--quick: none)")
    parser.add_argument("--against", type=Path, default=None,
                        help="a source tree of the code before: each audited run also on it, interleaved (see above)")
    args = parser.parse_args(argv)
    if args.quick:
        models, reps, args.every = {"gpt-tiny": ("gpt-tiny", None, 5)}, 1, [4]
    else:
        models, reps = {m: OVERHEAD_MODELS[m] for m in args.models}, args.reps
        if args.steps is not None:
            if args.steps < 5:
                parser.error(f"--steps {args.steps}: expected >= 5 (3 warm up)")
            models = {m: (spec, seq, args.steps) for m, (spec, seq, _) in models.items()}
    out = args.out or (None if args.quick else RESULTS)
    if out is not None and not out.parent.is_dir():
        parser.error(f"--out {out}: its folder does not exist")
    if any(e < 1 for e in args.every):
        parser.error(f"--every {args.every}: expected values >= 1 (one audited microbatch in every K)")
    if args.against is not None and not (args.against / "benchmarks" / "audit_overhead.py").is_file():
        parser.error(f"--against {args.against}: expected a source tree holding benchmarks/audit_overhead.py")
    first_load = os.getloadavg()

    def write(rows: list[dict[str, Any]]) -> None:
        load = {"load_before": [round(x, 2) for x in first_load], "load_after": [round(x, 2) for x in os.getloadavg()]}
        _write(out, rows, args, load)

    rows = measure(models, reps, tuple(args.every), baseline=not args.quick, plan=args.plan, against=args.against,
                   done_model=write)
    wide = [r for r in rows if r["model"] != "gpt-tiny"]
    goal = {e: all(r["overhead"] <= GOAL for r in wide if r["audit_every"] == e) for e in args.every} if wide else None
    print(f"goal (<= {GOAL:.0%} at d >= 384), by --audit-every: {'not measured' if goal is None else goal}")
    return 0


def _write(out: Path | None, rows: list[dict[str, Any]], args: argparse.Namespace, load: dict[str, Any]) -> None:
    """The result file, with ``rows`` so far (``--plan signed``: its own keys, the others kept)."""
    wide = [r for r in rows if r["model"] != "gpt-tiny"]
    goal = {e: all(r["overhead"] <= GOAL for r in wide if r["audit_every"] == e) for e in args.every} if wide else None
    if out is not None and args.plan == "copies":
        kept = {k: v for k, v in _old(out).items() if k.startswith("signed")}
        out.write_text(json.dumps({"rows": rows, "goal": GOAL, "goal_met_by_every": goal,
                                   "date": time.strftime("%Y-%m-%d"), **load,
                                   **({"before_tree": str(args.against)} if args.against else {}),
                                   "plan": "3 stages, middle untrusted, verifiers split: audits from copies", **kept},
                                  indent=1) + "\n")
    elif out is not None:
        out.write_text(json.dumps({**_old(out), "signed_rows": rows, "signed_goal_met_by_every": goal,
                                   "signed_date": time.strftime("%Y-%m-%d"),
                                   "signed_plan": "4 stages, 1 and 2 untrusted: stage 1 audited from copies, "
                                                  "stage 2 from signed inputs"}, indent=1) + "\n")


def _old(out: Path) -> dict[str, Any]:
    return json.loads(out.read_text()) if out.exists() else {}


if __name__ == "__main__":
    raise SystemExit(main())
