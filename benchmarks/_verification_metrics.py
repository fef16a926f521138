"""What the detection benchmark's emulated runs measure (``verification.py``): precision, recall and latencies per
attack, the false-positive rate of clean runs, and that rate at a wider model."""
from __future__ import annotations

import math
import statistics
import sys
from typing import Any

from benchmarks._verification_emulation import (
    ATTACKER,
    RunConfig,
    RunResult,
    plan_default_config,
    run,
)

__all__ = ["WIDE_CLEAN", "detection", "false_positive_rate", "median_step_ms", "wide_clean"]


def detection(results: list[RunResult], start: int) -> dict[str, Any]:
    """Precision, recall, F1 over (step, sender) pairs and latencies, pooled over runs."""
    tp = fp = fn = 0
    first, bans = [], []
    for r in results:
        positives = {(s, ATTACKER) for s in r.attacked_steps}
        predicted = {(s, who) for s, senders in r.blamed.items() for who in senders}
        tp += len(positives & predicted)
        fp += len(predicted - positives)
        fn += len(positives - predicted)
        hits = sorted(s for s, who in positives & predicted)
        first.append(hits[0] - start if hits else None)
        bans.append(None if r.ban_step is None else r.ban_step - start)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"tp": tp, "fp": fp, "fn": fn, "precision": round(precision, 4), "recall": round(recall, 4),
            "f1": round(f1, 4), "detect_latency_steps": first, "ban_latency_steps": bans,
            "banned": [r.banned for r in results]}


def false_positive_rate(results: list[RunResult], warmup: int, senders: int) -> dict[str, Any]:
    pairs = sum(len(who) for r in results for s, who in r.blamed.items())
    total = sum(max(0, len(r.step_ms) - warmup) * senders for r in results)
    return {"blamed_pairs": pairs, "pairs": total, "fpr": round(pairs / total, 5) if total else 0.0,
            "banned": [r.banned for r in results]}


def median_step_ms(results: list[RunResult]) -> float:
    return statistics.median(ms for r in results for ms in r.step_ms[5:])


# (learning rate, steps of linear warm-up): full-rate Adam from step 0 spikes the loss at d=256, lr 1e-3.
# Three seeds each: one seed's FPR hid a run whose drift test locked out (seed 2 at lr 1e-3).
WIDE_CLEAN = {"d_model": 256, "microbatch_size": 12, "steps": 100, "lrs": ((1e-3, 0), (3e-4, 0), (1e-3, 20)),
              "seeds": (0, 1, 2)}


def wide_clean(*, d_model: int, microbatch_size: int, steps: int, lrs: tuple[tuple[float, int], ...],
               seeds: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:
    """The false-positive rate of clean training at a wider model (gpt-tiny's FPR alone says
    nothing about a model whose boundary tensors go through the spectral projection and
    whose stages change faster), one row per learning rate and warm-up (``lrs``: pairs of
    a learning rate and steps of linear warm-up): 12 x 32 = 384 rows per microbatch. Also
    which tests flagged and the mean loss of the last 10 steps (a verifier dropping every
    microbatch stops training: the loss stays put)."""
    warmup = int(plan_default_config()["warmup"])
    rows = []
    for lr, lr_warmup in lrs:
        runs, reasons = [], {}
        for seed in seeds:
            cfg = RunConfig(steps=steps, microbatch_size=microbatch_size, lr=lr, lr_warmup=lr_warmup, seed=seed,
                            d_model=d_model)
            runs.append(run(cfg, keep_events=True))
            for e in runs[-1].flag_events:
                for reason in e["reasons"]:
                    key = f"{e['direction']} {e['boundary']} {e['scope']} {reason}"
                    reasons[key] = reasons.get(key, 0) + 1
        kept = [x for r in runs for x in r.losses[-10:] if not math.isnan(x)]
        honest_from = max(warmup, lr_warmup)
        rows.append({"model": f"gpt-tiny at d={d_model}", "d_model": d_model, "lr": lr, "lr_warmup": lr_warmup,
                     "steps": steps, "rows_per_microbatch": microbatch_size * cfg.seq, "seeds": list(seeds),
                     **false_positive_rate(runs, honest_from, cfg.stages),
                     "fpr_per_seed": [false_positive_rate([r], honest_from, cfg.stages)["fpr"] for r in runs],
                     "flags_by_test": reasons,
                     "loss_last10": round(sum(kept) / len(kept), 4) if kept else None,
                     "steps_all_dropped": sum(1 for r in runs for x in r.losses if math.isnan(x))})
        print(f"  wide clean d={d_model} lr={lr:g} lr warm-up {lr_warmup}: FPR {rows[-1]['fpr']:.4f}", file=sys.stderr,
              flush=True)
    return rows
