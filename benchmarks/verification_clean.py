"""Long clean runs of the integrity monitors on three plan shapes: does verification ban the honest?

The single-process emulation of ``benchmarks/verification.py`` (gpt-tiny, 4 stages, the
runtime's ``Verifier.check`` / ``flag_events`` / ``end_step`` calls), with no attacker,
for many steps, with the verifiers placed as three kinds of plan place them:

- ``one-verifier``: one verifier checks every boundary both ways (the placement the
  solver prefers: each stage's input and output seen together, so the link and
  residual tests apply; the detection benchmark's shape);
- ``split``: the uniform baseline's plan of issue 20 (trusted ends, ranks 1 and 2
  untrusted): boundary 0's gradients and boundary 2's activations on one verifier,
  boundary 1 both ways on another, the trusted ends' boundaries unchecked; no verifier
  sees both sides of a stage, so no link or residual test;
- ``replicated``: one verifier over every boundary, stage 1 replicated on two ranks (the
  odd microbatches' tensors are sent by rank 4, its replica).

Per shape: flags (per microbatch and per step), microbatches dropped, bans, the
per-sample false-positive rate (flagged checks / checks) and the rate over
(step, sender) pairs blamed.

    python benchmarks/verification_clean.py                       # 10^4 steps per shape
    python benchmarks/verification_clean.py --steps 200 --shapes split --out FILE
    python benchmarks/verification_clean.py --quick           # a smoke run: a few steps per shape, nothing written
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.verification import Pipeline, RunConfig, _write, run  # noqa: E402
from planner.integrity.blame import is_alert  # noqa: E402
from planner.integrity.verifier import Verifier  # noqa: E402

ALL = tuple((b, d) for b in range(3) for d in ("act", "grad"))
# shape -> (the verifiers' (boundary, direction) sets, {stage: the rank sending its odd microbatches})
SHAPES: dict[str, tuple[tuple[tuple[tuple[int, str], ...], ...], dict[int, int]]] = {
    "one-verifier": ((ALL,), {}),
    "split": ((((0, "grad"), (2, "act")), ((1, "act"), (1, "grad"))), {}),
    "replicated": ((ALL,), {1: 4}),
}
FPR_GOAL = 0.001   # per sample (issue 20)
QUICK_STEPS = 8
RESULTS = ROOT / "benchmarks" / "results" / "verification_clean.json"


class ShapedPipeline(Pipeline):
    """The emulated pipeline with the verifiers and senders of one plan shape; counts what it checks."""

    def __init__(self, cfg: RunConfig, shape: str, *, progress_every: int = 0) -> None:
        super().__init__(cfg)
        groups, self.replicas = SHAPES[shape]
        config = self.verifier.config.to_dict()   # the run's monitors' config (warm-up stretched as the runtime does)
        # the plan's view for blame among twins: each sender's stage and microbatches a step
        m = cfg.microbatches
        stage_of = {**{s: s for s in range(cfg.stages)}, **{r: s for s, r in self.replicas.items()}}
        per_rank = {r: m // 2 if s in self.replicas else m for r, s in stage_of.items()}
        self.verifiers = [Verifier(config, list(keys), stage_of=stage_of, microbatches=per_rank) for keys in groups]
        self.route = {key: v for v, keys in zip(self.verifiers, groups) for key in keys}
        self.verifier = self.verifiers[0]         # every verifier reaches the same bans
        self.counts = {"checks": 0, "flags_microbatch": 0, "flags_step": 0, "alerts": 0, "dropped": 0,
                       "blamed_pairs": 0}
        self.reasons: dict[str, int] = {}    # test -> flags it took part in (microbatch and step)
        self.progress_every, self.shape, self.t0 = progress_every, shape, time.perf_counter()

    def _check(self, boundary: int, direction: str, x: torch.Tensor, *, step: int, mb: int, sender: int,
               labels: torch.Tensor) -> bool:
        verifier = self.route.get((boundary, direction))
        if verifier is None:
            return True                                        # a trusted sender's boundary: not checked
        rank = self.replicas.get(sender, sender) if mb % 2 else sender
        verdict = verifier.check(boundary, direction, x, step=step, mb=mb, sender=rank, labels=labels)
        self.counts["checks"] += 1
        self.counts["flags_microbatch"] += int(verdict.flagged)
        self.counts["dropped"] += int(verdict.tainted)
        return not verdict.tainted

    def end_step(self, step: int) -> tuple[list[int], set[int]]:
        flags = [v.flag_events(step) for v in self.verifiers]
        flat = [e for group in flags for e in group]
        self.counts["flags_step"] += sum(1 for e in flat if e["scope"] == "step")
        self.counts["alerts"] += sum(1 for e in flat if is_alert(e))
        for e in flat:
            for reason in e["reasons"]:
                self.reasons[reason] = self.reasons.get(reason, 0) + 1
        banned = set().union(*(v.end_step(step, flags) for v in self.verifiers))
        blamed = sorted(self.verifier.last_blamed)   # every verifier blames alike; what the ban test counts
        self.counts["blamed_pairs"] += len(blamed)
        if self.progress_every and (step + 1) % self.progress_every == 0:
            print(f"  {self.shape} step {step + 1}: {self.counts}, banned {sorted(banned)}, "
                  f"{time.perf_counter() - self.t0:.0f} s", file=sys.stderr, flush=True)
        return blamed, banned


def clean_run(shape: str, *, steps: int, seed: int, progress_every: int = 0) -> dict[str, Any]:
    """One clean run of ``shape``: its counts, rates and bans."""
    built: list[ShapedPipeline] = []

    def factory(cfg: RunConfig) -> ShapedPipeline:
        built.append(ShapedPipeline(cfg, shape, progress_every=progress_every))
        return built[-1]

    t0 = time.perf_counter()
    result = run(RunConfig(steps=steps, seed=seed), pipeline=factory)
    pipe = built[0]
    counts = pipe.counts
    warmup = int(pipe.verifier.config.warmup)
    sender_ranks = _senders(shape)
    pairs = max(0, steps - warmup) * len(sender_ranks)
    return {"shape": shape, "steps": steps, "seed": seed, **counts,
            "fpr_per_sample": round(counts["flags_microbatch"] / max(1, counts["checks"]), 6),
            "fpr_pairs": round(counts["blamed_pairs"] / max(1, pairs), 6), "pairs": pairs,
            "senders": sorted(sender_ranks), "banned": result.banned, "flag_reasons": dict(sorted(pipe.reasons.items())),
            "blamed_steps": {str(k): v for k, v in pipe.verifier.summary()["blamed_steps"].items()},
            "val_loss": round(result.val_loss, 4), "duration_s": round(time.perf_counter() - t0, 1)}


def _senders(shape: str) -> set[int]:
    """The ranks whose tensors this shape checks."""
    groups, replicas = SHAPES[shape]
    ranks = {b if d == "act" else b + 1 for keys in groups for b, d in keys}
    return ranks | {replicas[r] for r in ranks if r in replicas}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per shape (default 10^4; --quick: {QUICK_STEPS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--progress-every", type=int, default=1000, help="print the counts every N steps")
    parser.add_argument("--out", default=None, help="rows are merged into this JSON (one per shape, steps and seed; "
                                                    "default benchmarks/results/verification_clean.json, none with "
                                                    "--quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few steps per shape, nothing written")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (QUICK_STEPS if args.quick else 10_000)
    out = Path(args.out) if args.out else (None if args.quick else RESULTS)
    for shape in args.shapes:
        row = clean_run(shape, steps=steps, seed=args.seed, progress_every=args.progress_every)
        row["goal_fpr_per_sample"] = row["fpr_per_sample"] <= FPR_GOAL and not row["banned"]
        print(f"{shape}: {row['steps']} steps, seed {row['seed']}: {row['checks']} checks, "
              f"{row['flags_microbatch']} microbatch flags ({100 * row['fpr_per_sample']:.3f}%), "
              f"{row['flags_step']} step flags ({row['alerts']} alerts), {row['dropped']} dropped, {row['blamed_pairs']} blamed pairs "
              f"({100 * row['fpr_pairs']:.3f}%), banned {row['banned']}, {row['duration_s']:.0f} s", flush=True)
        if out is None:
            continue
        report = json.loads(out.read_text()) if out.exists() else {"rows": []}
        report["rows"] = [r for r in report["rows"]
                          if (r["shape"], r["steps"], r["seed"]) != (shape, row["steps"], row["seed"])] + [row]
        report["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__}
        _write(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
