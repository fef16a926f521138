"""Detection benchmark of the integrity monitors (SENTINEL-style verification).

Real training of gpt-tiny on byte text (``models.data.ByteTextDataset``) as a
4-stage pipeline *emulated in one process*: every boundary tensor goes through
exactly the calls the distributed runtime makes (``Attacker.apply`` on the
sending rank, ``Verifier.check`` on one verifier that checks every boundary in
both directions, ``flag_events`` + ``end_step`` at the end of each step); a
flagged microbatch is dropped downstream, and a banned rank is planned around
(its stage runs honestly from then on). Rank r runs stage r, boundary b sits
between ranks b and b + 1, the attacker is rank 1 (a middle stage). The
monitors get the configuration a plan gets by default (``planner.plan.
VerifierConfig``), and the microbatch's token ids as labels (as
``planner.integrity.hooks.VerifyHooks`` gives them when the worker passes
it the run's data source).

Per attack, over (step, sender) pairs of runs where the attacker keeps
attacking after its ban (as in ``stagewise run``): precision, recall and F1,
detection and ban latency in steps; on clean runs the false-positive rate (also of
gpt-tiny's shape at d=256, lr 1e-3 and 3e-4: the spectral projection on, stages that
change faster; ``clean_wide`` in the JSON);
the validation loss after training clean / attacked with verification (the
banned rank planned around) / attacked without, and the attack's damage (the
last minus clean: what it does if nobody detects it). Two adaptive attacks:
``adaptive`` models the summary distances (all the harness gives a rank is what
it sends); ``adaptive-whitebox`` also gets its stage's input here, so it fits
the link test and its residual's shape as the verifier does and knows the
published fence floors and ratios (emulation only: the runtime's harness does
not hand an attacker its input).

Overhead, three ways: the CPU time of verification in the emulation (serial,
an upper bound: gpt-tiny's stages are tiny); the cost of one stage's two checks
against its forward + backward at wider models; and ``stagewise run`` itself
(the real distributed runtime, gloo, one process per rank) with and without
verification, for gpt-tiny and GPTs of d=384 and d=768, with the verifier on a stage rank
or on a CPU-only verifier host.

    python benchmarks/verification.py            # writes benchmarks/results/verification.json
    python benchmarks/verification.py --quick    # a smoke run of every section, tiny: writes nothing unless --out
    python benchmarks/verification.py --only detection --out FILE   # all but `stagewise run` on vs off
    python benchmarks/verification.py --only clean_wide --out FILE  # rerun only the wide clean runs, merged into FILE
    python benchmarks/verification.py --only overhead [--models gpt-tiny] [--reps 2] [--wait-first]
                                                 # rerun only `stagewise run` on vs off, merged into the JSON
    python benchmarks/verification.py --only contributions  # the replicas' contribution checks' CPU cost, merged
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._verification_cost import check_cost, contribution_cost
from benchmarks._verification_distributed import (
    OVERHEAD_MODELS,
    allowed_model,
    distributed_overhead,
    overhead_plan,
    wide_gpt,
    wider_gpt,
)
from benchmarks._verification_emulation import (
    ATTACKER,
    Pipeline,
    RunConfig,
    RunResult,
    plan_default_config,
    run,
)
from benchmarks._verification_merge import (
    only_clean_wide,
    only_contributions,
    only_overhead,
)
from benchmarks._verification_metrics import (
    WIDE_CLEAN,
    detection,
    false_positive_rate,
    median_step_ms,
    wide_clean,
)
from benchmarks._verification_report import (
    GOALS,
    distributed_goals,
    print_table,
    wide_key,
    write_json,
)

# What the other benchmarks and the wide models' factory specs (``WIDE_GPT``) import from here.
__all__ = ["ATTACKER", "ATTACKS", "OVERHEAD_MODELS", "Pipeline", "RunConfig", "RunResult", "allowed_model",
           "check_cost", "contribution_cost", "detection", "overhead_plan", "plan_default_config", "run",
           "wide_gpt", "wider_gpt"]
_write = write_json   # the name verification_clean, _codecs and _sweep import

ATTACKS: dict[str, str] = {
    "constant": "kind=constant",
    "zeros": "kind=zeros",
    "random": "kind=random",
    "scale-1": "kind=scale,factor=-1",
    "grad-sign-flip": "kind=sign_flip",
    "random-sign": "kind=random_sign",
    "delay": "kind=delay,steps=2",
    "bias": "kind=bias",
    "noise": "kind=noise",
    "noise-grad": "kind=noise,dir=grad",
    "mixed": "kind=mixed,dir=both",
    "adaptive": "kind=adaptive",
    "adaptive-whitebox": "kind=adaptive,model=full",
}
CONTRIBUTION_WIDTHS = (64, 384, 768)   # the replicas' contribution checks: the goal holds at d >= 384
RESULTS = ROOT / "benchmarks" / "results" / "verification.json"

# --quick: every section on its smallest case (the monitors' 5 warm-up steps, then a few attacked ones)
QUICK: dict[str, Any] = {"steps": 10, "start": 6, "attacks": ("zeros", "grad-sign-flip"), "overhead_steps": 3,
                         "wide": {**WIDE_CLEAN, "microbatch_size": 2, "steps": 6, "lrs": ((1e-3, 0),), "seeds": (0,)},
                         "cost": {"widths": (64,), "seq": 32, "steps": 2},
                         "distributed": {"hosts": (False,), "depth": 2}}


def benchmark(*, steps: int, clean_steps: int, seeds: list[int], start: int, attacks: dict[str, str],
              labels: bool, distributed: dict[str, tuple[str, int | None, int]], reps: int,
              wide: dict[str, Any] | None = None, cost: dict[str, Any] | None = None,
              distributed_shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every section; ``cost``: check_cost's arguments (default: widths 64, 256 and, with more than four
    attacks, 768); ``distributed_shape``: distributed_overhead's ``hosts`` and ``depth`` (default: both
    verifier placements, 4 stages)."""
    base = RunConfig(steps=steps, start=start, labels=labels)
    clean_cfg = RunConfig(steps=clean_steps, start=start, labels=labels)
    clean_on = [run(_with(clean_cfg, seed=s)) for s in seeds]
    clean_off = [run(_with(clean_cfg, seed=s, verify=False)) for s in seeds]
    short_clean = [run(_with(base, seed=s, verify=False)) for s in seeds] if clean_steps != steps else clean_off
    senders = base.stages                                   # every rank sends on some checked boundary
    warmup = int(base.verifier_config["warmup"])
    on_ms, off_ms = median_step_ms(clean_on), median_step_ms(clean_off)
    checks = sum(r.checks for r in clean_on)
    report: dict[str, Any] = {
        "setup": {"model": "gpt-tiny", "stages": base.stages, "microbatches": base.microbatches,
                  "microbatch_size": base.microbatch_size, "seq": base.seq, "optimizer": "adam", "lr": base.lr,
                  "steps": steps, "clean_steps": clean_steps, "attack_start": start, "seeds": seeds,
                  "attacker_rank": ATTACKER, "labels": labels, "verifier_config": base.verifier_config,
                  "pipeline": "single-process emulation; one verifier checks every boundary both ways"},
        "clean": {**false_positive_rate(clean_on, warmup, senders),
                  "val_loss": _mean(r.val_loss for r in clean_off)},
        "overhead": {"step_ms_verify_on": round(on_ms, 2), "step_ms_verify_off": round(off_ms, 2),
                     "overhead": round(on_ms / off_ms - 1.0, 4),
                     "us_per_check": round(1e3 * sum(r.verify_ms for r in clean_on) / max(1, checks), 1)},
        "attacks": {},
    }
    report["clean_wide"] = wide_clean(**wide) if wide else []
    report["overhead"]["at_width"] = check_cost(**(cost or {"widths": (64, 256, 768) if len(attacks) > 4
                                                            else (64, 256)}))
    report["overhead"]["distributed"] = distributed_overhead(distributed, reps=reps, **(distributed_shape or {}))
    clean_val = _mean(r.val_loss for r in short_clean)
    for name, spec in attacks.items():
        on = [run(_with(base, seed=s, attack=spec)) for s in seeds]            # the attacker never stops
        replanned = [run(_with(base, seed=s, attack=spec, replan=True)) for s in seeds]
        off = [run(_with(base, seed=s, attack=spec, verify=False)) for s in seeds]
        verified, unverified = _mean(r.val_loss for r in replanned), _mean(r.val_loss for r in off)
        # Damage: how much the attack raises the validation loss over clean training of the
        # same length (an attack that does none is not worth detecting).
        report["attacks"][name] = {"spec": spec, **detection(on, start),
                                   "val_loss_clean": clean_val,
                                   "val_loss_attacked_verified": verified,
                                   "val_loss_attacked_unverified": unverified,
                                   "damage_verified": round(verified - clean_val, 4),
                                   "damage_unverified": round(unverified - clean_val, 4)}
        print(f"  {name:15s} done", file=sys.stderr, flush=True)
    return report


def _with(cfg: RunConfig, **changes: Any) -> RunConfig:
    return RunConfig(**{**asdict(cfg), **changes})


def _mean(values) -> float:
    values = list(values)
    return round(sum(values) / len(values), 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, short runs, a few attacks")
    parser.add_argument("--no-labels", dest="labels", action="store_false",
                        help="do not give the monitors the token ids")
    parser.add_argument("--reps", type=int, default=2, help="runs per setting of the distributed overhead")
    parser.add_argument("--out", default=None, help="the JSON to write or merge into (default "
                                                    "benchmarks/results/verification.json, none with --quick)")
    parser.add_argument("--only", choices=("all", "overhead", "detection", "clean_wide", "contributions"),
                        default="all",
                        help="overhead: rerun only the distributed overhead (`stagewise run` on vs off) and "
                             "merge it into --out; detection: everything but the distributed overhead; "
                             "clean_wide: rerun only the clean runs at d=256 and merge them into --out; "
                             "contributions: only the cost of the replicas' contribution checks, merged")
    parser.add_argument("--wait-first", action="store_true",
                        help="also time verification that waits for each verdict first (the executor's old way)")
    parser.add_argument("--models", nargs="+", choices=list(OVERHEAD_MODELS), default=list(OVERHEAD_MODELS),
                        help="models of the distributed overhead")
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="with --only overhead: emulate every stage device this many times slower than this "
                             "CPU (results in overhead.distributed_emulated)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else (None if args.quick else RESULTS)
    if args.only == "overhead":
        return only_overhead(out, reps=args.reps, models=args.models, wait_first=args.wait_first,
                             slowdown=args.slowdown, steps=QUICK["overhead_steps"] if args.quick else None)
    if args.only == "clean_wide":
        return only_clean_wide(out, wide=QUICK["wide"] if args.quick else WIDE_CLEAN)
    if args.only == "contributions":
        return only_contributions(out, widths=(64,) if args.quick else CONTRIBUTION_WIDTHS)
    detection_only = args.only == "detection"
    if args.quick:
        attacks = {k: ATTACKS[k] for k in QUICK["attacks"]}
        report = benchmark(steps=QUICK["steps"], clean_steps=QUICK["steps"], seeds=[0], start=QUICK["start"],
                           attacks=attacks, labels=args.labels, reps=1,
                           distributed={} if detection_only else {"gpt-tiny": ("gpt-tiny", None,
                                                                               QUICK["overhead_steps"])},
                           wide=QUICK["wide"], cost=QUICK["cost"], distributed_shape=QUICK["distributed"])
    else:
        report = benchmark(steps=60, clean_steps=200, seeds=[0, 1], start=20, attacks=ATTACKS, labels=args.labels,
                           distributed={} if detection_only else {m: OVERHEAD_MODELS[m] for m in args.models},
                           reps=args.reps, wide=WIDE_CLEAN)
    old = json.loads(out.read_text()) if detection_only and out is not None and out.exists() else {}
    for key, value in old.get("overhead", {}).items():
        if key.startswith("distributed"):   # --only detection times no distributed run: the last stays
            report["overhead"][key] = value
    report["goals"] = {"f1_all": all(r["f1"] >= GOALS["f1"] for r in report["attacks"].values()),
                       "fpr": report["clean"]["fpr"] <= GOALS["fpr"],
                       "fpr_wide": {wide_key(r): r["fpr"] <= GOALS["fpr"]
                                    for r in report["clean_wide"]},
                       "overhead": report["overhead"]["at_width"][-1]["overhead"] <= GOALS["overhead"],
                       "overhead_distributed": distributed_goals(report["overhead"]["distributed"]),
                       **{k: v for k, v in old.get("goals", {}).items() if k == "overhead_distributed_emulated"}}
    report["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__,
                         "note": "timings on a shared, loaded machine are noisy"}
    print_table(report)
    if out is not None:
        write_json(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
