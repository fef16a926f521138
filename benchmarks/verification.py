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
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cost_models.cluster_file import parse_cluster
from models.data import ByteTextDataset
from models.registry import PRESETS, lm_loss
from planner.integrity import contributions as contrib
from planner.integrity import robust_reduce
from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.verifier import Verifier
from planner.runtime.rank.rank_setup import make_lr_warmup
from planner.simulate import predict
from planner.verifier_config import VerifierConfig

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
GOALS = {"f1": 0.95, "fpr": 0.005, "overhead": 0.05}
CONTRIBUTION_WIDTHS = (64, 384, 768)   # the replicas' contribution checks: the goal holds at d >= 384
ATTACKER = 1
RESULTS = ROOT / "benchmarks" / "results" / "verification.json"


def plan_default_config() -> dict[str, Any]:
    """The monitors' config a plan gives by default."""
    return VerifierConfig().to_dict()


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """One emulated training run."""

    steps: int = 80
    stages: int = 4
    microbatches: int = 4
    microbatch_size: int = 4
    seq: int = 32
    lr: float = 1e-3
    lr_warmup: int = 0              # steps of linear learning-rate warm-up (`stagewise run --lr-warmup`)
    seed: int = 0
    attack: str | None = None       # spec without rank/start
    start: int = 20
    verify: bool = True
    labels: bool = True             # pass token ids to the monitors (the binding test), as VerifyHooks does
    replan: bool = False            # a banned attacker is planned around (else it keeps attacking)
    d_model: int | None = None      # None: gpt-tiny (d=64); else gpt-tiny's shape at this width
    verifier_config: dict = field(default_factory=plan_default_config)


@dataclass(slots=True, kw_only=True)
class RunResult:
    val_loss: float
    losses: list[float]
    step_ms: list[float]
    blamed: dict[int, list[int]]
    attacked_steps: list[int]
    ban_step: int | None
    banned: list[int]
    checks: int
    verify_ms: float
    flag_events: list[dict] = field(default_factory=list)   # the verifier's flags (run(keep_events=True))


def wide_tiny(d_model: int) -> torch.nn.Module:
    """gpt-tiny (4 layers, 4 heads, byte vocabulary, 32 tokens) at width ``d_model``: wide
    enough for the spectral projection (d > MAX_SPECTRAL_DIMS) and for a stage whose
    residual shape moves faster than at d=64."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=32, n_layers=4, d_model=d_model, n_heads=4))


def split_stages(model: torch.nn.Module, stages: int) -> list[torch.nn.Module]:
    """embed + first layers | ... | last layers + head, layers spread evenly."""
    layers = list(model.layers)
    bounds = [round(i * len(layers) / stages) for i in range(stages + 1)]
    return [torch.nn.Sequential(*([model.embed] if s == 0 else []), *layers[bounds[s]:bounds[s + 1]],
                                *([model.head] if s == stages - 1 else []))
            for s in range(stages)]


class Pipeline:
    """The stages of one model run in order, with the runtime's verification calls."""

    def __init__(self, cfg: RunConfig) -> None:
        torch.manual_seed(cfg.seed)
        model = PRESETS["gpt-tiny"].build() if cfg.d_model is None else wide_tiny(cfg.d_model)
        model.init_weights(cfg.seed)
        self.cfg, self.model = cfg, model
        self.stages = split_stages(model, cfg.stages)
        self.opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.lr_warmup = make_lr_warmup(self.opt, cfg.lr_warmup)  # the runtime's own schedule
        boundaries = [(b, d) for b in range(cfg.stages - 1) for d in ("act", "grad")]
        # As the runtime does (verify_hooks.monitor_config): the honest warm-up covers the lr warm-up.
        vcfg = {**cfg.verifier_config, "warmup": max(int(cfg.verifier_config["warmup"]), cfg.lr_warmup)}
        self.verifier = Verifier(vcfg, boundaries) if cfg.verify else None
        self.attacker = None
        if cfg.attack:
            self.attacker = Attacker(parse_attack(f"rank={ATTACKER},start={cfg.start},{cfg.attack}"), seed=cfg.seed)
        self.verify_s = 0.0

    def _check(self, boundary: int, direction: str, x: torch.Tensor, *, step: int, mb: int, sender: int,
               labels: torch.Tensor) -> bool:
        """True when the tensor may be used (the verdict is not tainted)."""
        if self.verifier is None:
            return True
        t0 = time.process_time()
        verdict = self.verifier.check(boundary, direction, x, step=step, mb=mb, sender=sender,
                                      labels=labels if self.cfg.labels else None)
        self.verify_s += time.process_time() - t0
        return not verdict.tainted

    def _send(self, x: torch.Tensor, rank: int, direction: str, step: int, mb: int,
              stage_input: torch.Tensor | None) -> torch.Tensor:
        if self.attacker is not None and rank == self.attacker.spec.rank:
            return self.attacker.apply(x, direction=direction, step=step, mb=mb, stage_input=stage_input)
        return x

    def microbatch(self, idx: torch.Tensor, tgt: torch.Tensor, step: int, mb: int) -> float | None:
        """Forward and backward of one microbatch; its loss, or None when it was dropped."""
        last = len(self.stages) - 1
        inputs, outputs, h = [], [], idx
        for s, stage in enumerate(self.stages):            # forward, checking every activation sent
            h_in = h if s == 0 else h.detach().requires_grad_(True)
            out = stage(h_in)
            inputs.append(h_in)
            outputs.append(out)
            if s < last:
                h = self._send(out.detach(), s, "act", step, mb, stage_input=h_in.detach())
                if not self._check(s, "act", h, step=step, mb=mb, sender=s, labels=idx):
                    return None                                # dropped: no loss, no backward
        loss = lm_loss(outputs[-1], tgt) / self.cfg.microbatches
        value = float(loss.detach()) * self.cfg.microbatches
        grad = None
        for s in range(last, -1, -1):                       # backward, checking every gradient sent
            if s == last:
                loss.backward()
            else:
                outputs[s].backward(grad)
            if s == 0:
                return value
            grad = self._send(inputs[s].grad, s, "grad", step, mb, stage_input=grad)
            if not self._check(s - 1, "grad", grad, step=step, mb=mb, sender=s, labels=tgt):
                return value                                   # upstream stages get nothing
        return value

    def end_step(self, step: int) -> tuple[list[int], set[int]]:
        if self.verifier is None:
            return [], set()
        flags = self.verifier.flag_events(step)
        banned = self.verifier.end_step(step, [flags])
        return sorted(self.verifier.last_blamed), banned   # the blame the ban test counts


def run(cfg: RunConfig, *, keep_events: bool = False, pipeline: Callable[[RunConfig], Pipeline] = Pipeline
        ) -> RunResult:
    """One emulated run; ``pipeline`` builds the pipeline (a subclass places the verifiers otherwise)."""
    pipe = pipeline(cfg)
    train = ByteTextDataset(cfg.seq, "train")
    val_idx, val_tgt = ByteTextDataset(cfg.seq, "val").batch(0, 64, seed=1000 + cfg.seed)
    attacker = pipe.attacker
    result = RunResult(val_loss=float("nan"), losses=[], step_ms=[], blamed={}, attacked_steps=[], ban_step=None,
                       banned=[], checks=0, verify_ms=0.0)
    m, bs = cfg.microbatches, cfg.microbatch_size
    for step in range(cfg.steps):
        t0 = time.process_time()   # CPU time: the machine is shared, wall time is not ours
        idx, tgt = train.batch(step, m * bs, seed=cfg.seed)
        pipe.opt.zero_grad(set_to_none=True)
        kept = [pipe.microbatch(idx[mb * bs:(mb + 1) * bs], tgt[mb * bs:(mb + 1) * bs], step, mb)
                for mb in range(m)]
        kept = [loss for loss in kept if loss is not None]
        result.losses.append(sum(kept) / len(kept) if kept else float("nan"))
        blamed, banned = pipe.end_step(step)
        result.blamed[step] = blamed
        if pipe.attacker is not None and pipe.attacker.spec.rank in banned and result.ban_step is None:
            result.ban_step = step
            if cfg.replan:
                pipe.attacker = None      # planned around: an honest device takes the stage over
        pipe.opt.step()
        if pipe.lr_warmup is not None:
            pipe.lr_warmup.step()
        result.step_ms.append(1e3 * (time.process_time() - t0))
    with torch.no_grad():
        h = val_idx
        for stage in pipe.stages:
            h = stage(h)
        result.val_loss = float(lm_loss(h, val_tgt))
    if attacker is not None:
        result.attacked_steps = sorted(attacker.attacked_steps())
    if pipe.verifier is not None:
        result.banned = sorted(pipe.verifier.banned)
        result.checks = sum(mon["checked"] for mon in pipe.verifier.summary()["monitors"])
        result.verify_ms = 1e3 * pipe.verify_s
        if keep_events:
            result.flag_events = [e for e in pipe.verifier.events if e["type"] == "flag"]
    return result


# ---------------------------------------------------------------------------- metrics

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
# --quick: every section on its smallest case (the monitors' 5 warm-up steps, then a few attacked ones)
QUICK: dict[str, Any] = {"steps": 10, "start": 6, "attacks": ("zeros", "grad-sign-flip"), "overhead_steps": 3,
                         "wide": {**WIDE_CLEAN, "microbatch_size": 2, "steps": 6, "lrs": ((1e-3, 0),), "seeds": (0,)},
                         "cost": {"widths": (64,), "seq": 32, "steps": 2},
                         "distributed": {"hosts": (False,), "depth": 2}}


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
        kept = [x for r in runs for x in r.losses[-10:] if x == x]
        honest_from = max(warmup, lr_warmup)
        rows.append({"model": f"gpt-tiny at d={d_model}", "d_model": d_model, "lr": lr, "lr_warmup": lr_warmup,
                     "steps": steps, "rows_per_microbatch": microbatch_size * cfg.seq, "seeds": list(seeds),
                     **false_positive_rate(runs, honest_from, cfg.stages),
                     "fpr_per_seed": [false_positive_rate([r], honest_from, cfg.stages)["fpr"] for r in runs],
                     "flags_by_test": reasons,
                     "loss_last10": round(sum(kept) / len(kept), 4) if kept else None,
                     "steps_all_dropped": sum(1 for r in runs for x in r.losses if x != x)})
        print(f"  wide clean d={d_model} lr={lr:g} lr warm-up {lr_warmup}: FPR {rows[-1]['fpr']:.4f}", file=sys.stderr,
              flush=True)
    return rows


# ---------------------------------------------------------------------------- cost at realistic widths

def check_cost(widths: tuple[int, ...], *, seq: int = 128, microbatch: int = 4, layers: int = 3,
               steps: int = 8) -> list[dict[str, Any]]:
    """CPU time of one stage (``layers`` GPT blocks) forward + backward per microbatch, against
    the two checks its outputs get (activation out, gradient out; the link test included)."""
    from models.gpt import GPTBlock, GPTConfig

    rows = []
    for d in widths:
        cfg = GPTConfig(vocab_size=256, max_seq=seq, n_layers=layers, d_model=d, n_heads=max(1, d // 64))
        stage = torch.nn.Sequential(*[GPTBlock(cfg) for _ in range(layers)])
        verifier = Verifier(plan_default_config(), [(0, "act"), (1, "act"), (0, "grad"), (1, "grad")])
        compute = checks = 0.0
        timed = 0
        for step in range(steps):
            for mb in range(4):
                x = torch.randn(microbatch, seq, d, requires_grad=True)
                t0 = time.process_time()
                y = stage(x)
                y.backward(torch.randn_like(y) * 1e-3)
                t1 = time.process_time()
                verifier.check(0, "act", x.detach(), step=step, mb=mb, sender=0)
                t2 = time.process_time()
                verifier.check(1, "act", y.detach(), step=step, mb=mb, sender=1)
                verifier.check(1, "grad", torch.randn_like(y) * 1e-3, step=step, mb=mb, sender=2)
                t3 = time.process_time()
                verifier.check(0, "grad", x.grad, step=step, mb=mb, sender=1)
                t4 = time.process_time()
                if step >= steps // 2:         # fences ready: the steady-state cost
                    compute += t1 - t0
                    checks += (t2 - t1) / 2 + (t4 - t3) + (t3 - t2) / 2
                    timed += 1
            verifier.end_step(step, [verifier.flag_events(step)])
        rows.append({"d_model": d, "seq": seq, "microbatch": microbatch, "layers_per_stage": layers,
                     "stage_fwd_bwd_ms": round(1e3 * compute / timed, 2),
                     "checks_ms": round(1e3 * checks / timed, 2), "overhead": round(checks / compute, 4)})
    return rows


def contribution_cost(widths: tuple[int, ...], *, seq: int = 128, microbatch: int = 4, layers: int = 3,
                      microbatches: int = 4, replicas: int = 2, steps: int = 6) -> list[dict[str, Any]]:
    """Issue 37's checks of a replicated stage (``layers`` GPT blocks, ``microbatches`` a replica a step)
    against a replica's forwards + backwards of a step, CPU time: the sketch each replica makes of its
    gradient contribution, the lead verifier's judgement of ``replicas`` sketches, and the optional robust
    sum (centered clipping of ``replicas`` contributions, per replica)."""
    from models.gpt import GPTBlock, GPTConfig

    rows = []
    for d in widths:
        cfg = GPTConfig(vocab_size=256, max_seq=seq, n_layers=layers, d_model=d, n_heads=max(1, d // 64))
        stage = torch.nn.Sequential(*[GPTBlock(cfg) for _ in range(layers)])
        monitor = contrib.ContributionMonitor(seed=0)
        seed = contrib.sketch_seed(0, 1)
        times: dict[str, list[float]] = {"compute": [], "sketch": [], "judge": [], "robust": []}
        reference, radius = None, None   # the runtime's: the EMA of past robust sums (its first step: the median)
        for step in range(steps):
            t0 = time.process_time()
            for _ in range(microbatches):
                x = torch.randn(microbatch, seq, d, requires_grad=True)
                stage(x).backward(torch.randn(microbatch, seq, d) * 1e-3)
            t1 = time.process_time()
            flat = torch.cat([p.grad.reshape(-1) for p in stage.parameters()])
            t2 = time.process_time()
            mine = contrib.sketch(flat, seed=seed)
            t3 = time.process_time()
            peers = [flat + 1e-3 * torch.randn_like(flat) for _ in range(replicas - 1)]
            sketches = {0: mine, **{r + 1: contrib.sketch(c, seed=seed) for r, c in enumerate(peers)}}
            t4 = time.process_time()
            monitor.judge(1, sketches, step=step)
            t5 = time.process_time()
            robust_reduce.centered_clip([flat, *peers], reference=reference, history_radius=radius)
            t6 = time.process_time()
            reference, radius = flat.clone(), float(flat.norm())
            stage.zero_grad(set_to_none=True)
            if step >= 1:   # the first warms up
                for key, dt in (("compute", t1 - t0), ("sketch", t3 - t2), ("judge", t5 - t4), ("robust", t6 - t5)):
                    times[key].append(1e3 * dt)
        med = {key: statistics.median(v) for key, v in times.items()}
        rows.append({"d_model": d, "params": flat.numel(), "replicas": replicas,
                     "microbatches_per_replica": microbatches, "replica_step_compute_ms": round(med["compute"], 1),
                     "sketch_ms": round(med["sketch"], 2), "judge_ms": round(med["judge"], 2),
                     "robust_sum_ms": round(med["robust"], 2),
                     "overhead": round((med["sketch"]) / med["compute"], 4),
                     "overhead_robust": round((med["sketch"] + med["robust"]) / med["compute"], 4)})
    return rows


# ---------------------------------------------------------------------------- the distributed runtime

WIDE_GPT = "benchmarks.verification:wide_gpt"
WIDE_SEQ = 128


WIDER_GPT = "benchmarks.verification:wider_gpt"


def wide_gpt():
    """A wider model for the distributed overhead (a factory for ``build_model``): 8 layers,
    d=384, byte vocabulary, 128-token windows."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=WIDE_SEQ, n_layers=8, d_model=384, n_heads=6))


def wider_gpt():
    """A realistic width (GPT-2 small's d=768) for the distributed overhead: 4 layers (one per
    stage, so that a step stays a few seconds on a shared 2-core machine), 128-token windows."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=WIDE_SEQ, n_layers=4, d_model=768, n_heads=12))


# name -> (model spec, seq, steps per run): few steps for the wide ones (the first 3 are warm-up)
OVERHEAD_MODELS: dict[str, tuple[str, int | None, int]] = {
    "gpt-tiny": ("gpt-tiny", None, 30), "gpt d=384": (WIDE_GPT, WIDE_SEQ, 8), "gpt d=768": (WIDER_GPT, WIDE_SEQ, 6)}


def overhead_plan(spec: str, folder: Path, *, host: bool, seq: int | None = None, depth: int = 4,
                  untrusted: frozenset[int] = frozenset(), split: bool = False) -> Path:
    """A ``depth``-stage, 4-microbatch plan of ``spec`` on local CPUs whose verifier checks every
    boundary both ways: a CPU-only verifier host (rank ``depth``) if ``host``, else rank 0 (the
    first stage's device, trusted) as the tests' plans and a small deployment would. ``untrusted``: the stages
    on untrusted hosts; ``split``: boundary 0 verified by rank 0, the others by the last stage's rank."""
    from cost_models.training import TrainingConfig
    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.compile import compile_plan
    from planner.plan_values import ModelRef
    from planner.solver.policy import VerificationPolicy
    from planner.solver.solution import (
        Solution,
        SolveReport,
        StagePlacement,
        VerifierPlacement,
    )
    from planner.trace import trace

    microbatch, count = 4, 4
    bundle = build_model(spec, batch=microbatch, seq=seq, device="meta")
    chain = coarsen(trace(bundle.module, bundle.example_inputs, name=spec))
    hosts = [{"name": f"h{i}", "region": "local", "trust": f"v{i}" if i in untrusted else "operator",
              "trusted": i not in untrusted, "devices": [{"type": "CPU", "count": 1}]} for i in range(depth)]
    if host:
        hosts.append({"name": "verifier", "region": "local", "trust": "operator", "trusted": True,
                      "role": "verifier"})
    cluster = parse_cluster({"name": "local", "hosts": hosts,
                                     "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                               "default": {"bandwidth_gbps": 10, "latency_ms": 0.05}}})
    ids = [d.id for d in cluster.devices]
    layers = len(chain.blocks) - 2                       # embed, layers..., head
    cuts = [1 + round(k * layers / depth) for k in range(depth + 1)]
    ranges = [(0 if k == 0 else cuts[k], len(chain.blocks) - 1 if k == depth - 1 else cuts[k + 1] - 1)
              for k in range(depth)]
    stages = tuple(StagePlacement(index=k, first_block=lo, last_block=hi, devices=(ids[k],), microbatches=(count,))
                   for k, (lo, hi) in enumerate(ranges))
    verifier = ids[depth] if host else ids[0]
    checks = tuple(VerifierPlacement(boundary=b, device=ids[depth - 1] if split and b else verifier,
                                     directions=("act", "grad")) for b in range(depth - 1))
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    solution = Solution(stages=stages, verifiers=checks, num_microbatches=count, schedule="1f1b",
                        predicted_step_ms=0.0, memory_bytes=(), report=report)
    config = TrainingConfig(global_batch=microbatch * count, microbatch_size=microbatch, schedule="1f1b",
                            optimizer="adam")
    ref = ModelRef(spec=spec, name=spec, fingerprint=chain.fingerprint, batch=microbatch, seq=seq)
    plan = predict(compile_plan(solution, chain, cluster, config, VerificationPolicy(enabled=True, trusted_endpoints=False),
                        ref, verifier_config=VerifierConfig()))
    return plan.save(folder / f"{spec.split(':')[-1]}-{'host' if host else 'stage'}{'-split' if split else ''}.json")


def distributed_overhead(models: dict[str, tuple[str, int | None, int]], *, reps: int,
                         wait_first: bool = False, slowdown: float = 1.0,
                         hosts: tuple[bool, ...] = (False, True), depth: int = 4) -> list[dict[str, Any]]:
    """Step time of ``stagewise run`` with and without verification (the same plan, runs
    interleaved so that the machine's load drifts into both alike): per model and verifier
    placement, the median over runs of each run's median step (wall) and of its CPU time
    summed over ranks (what a shared machine's load inflates least). ``models``: name ->
    (spec, seq, steps). ``wait_first``: also run verification waiting for each verdict
    before using the tensor (``--wait-verdicts``, the executor's old way). ``slowdown`` > 1:
    every stage's compute emulated ``slowdown`` times slower than this CPU (``stagewise run
    --emulate-speed --emulate-slowdown``), so its core idles during compute as a GPU's host
    CPU does, and the checks can overlap it as they would there. ``hosts``: the verifier placements timed
    (True: on a CPU verifier host, False: on stage rank 0); ``depth``: the plans' stages."""
    import tempfile

    modes = ("off", "on") + (("wait",) if wait_first else ())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (spec, seq, steps) in models.items():
            for host in hosts:
                path = overhead_plan(spec, Path(tmp), host=host, seq=seq, depth=depth)
                runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
                for _ in range(reps):
                    for mode in modes:
                        runs[mode].append(_overhead_run(path, steps, mode, slowdown, model=allowed_model(spec)))
                ms = {m: statistics.median(r["ms"] for r in runs[m]) for m in modes}
                cpu = {m: statistics.median(r["cpu"] for r in runs[m]) for m in modes}
                row = {"model": name, "verifier": f"CPU host (rank {depth})" if host else "stage rank 0",
                       "steps": steps, "runs": reps, "slowdown": slowdown, "step_ms_verify_on": round(ms["on"], 1),
                       "step_ms_verify_off": round(ms["off"], 1), "overhead": round(ms["on"] / ms["off"] - 1.0, 4),
                       "cpu_ms_verify_on": round(cpu["on"], 1), "cpu_ms_verify_off": round(cpu["off"], 1),
                       "cpu_overhead": round(cpu["on"] / cpu["off"] - 1.0, 4)}
                if wait_first:
                    row.update({"step_ms_wait_first": round(ms["wait"], 1),
                                "overhead_wait_first": round(ms["wait"] / ms["off"] - 1.0, 4),
                                "cpu_ms_wait_first": round(cpu["wait"], 1),
                                "cpu_overhead_wait_first": round(cpu["wait"] / cpu["off"] - 1.0, 4)})
                rows.append(row)
                before = (f" (waiting first: {row['overhead_wait_first']:+.1%} wall, "
                          f"{row['cpu_overhead_wait_first']:+.1%} CPU)") if wait_first else ""
                print(f"  distributed {name} {row['verifier']}: {row['overhead']:+.1%} wall, "
                      f"{row['cpu_overhead']:+.1%} CPU{before}", file=sys.stderr, flush=True)
    return rows


def allowed_model(spec: str) -> str | None:
    """``run --model``: a factory spec (``module:function``) runs only where the user allows it by name."""
    return spec if ":" in spec else None


def _overhead_run(path: Path, steps: int, mode: str, slowdown: float = 1.0, *, model: str | None = None) -> dict[str, float]:
    """One ``stagewise run``: verification off, on (deferred verdicts) or on waiting first."""
    from planner.runtime.launcher.launch import launch
    from planner.runtime.options import RunOptions

    result = launch(RunOptions(plan=str(path), steps=steps, timeout_s=600, model=model, verify=mode != "off",
                               wait_verdicts=mode == "wait", emulate=slowdown > 1.0, emulate_slowdown=slowdown))
    warm = min(3, steps - 1)
    return {"ms": statistics.median(result["step_ms"][warm:]), "cpu": statistics.median(result["cpu_ms"][warm:])}


# ---------------------------------------------------------------------------- the benchmark

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


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Verification: detection per attack (pairs = (step, sender))")
    for col in ("attack", "precision", "recall", "F1", "detect (steps)", "ban (steps)", "val loss verified",
                "val loss unverified", "damage unverified"):
        table.add_column(col, justify="right" if col != "attack" else "left")
    for name, row in report["attacks"].items():
        table.add_row(name, f"{row['precision']:.3f}", f"{row['recall']:.3f}", f"{row['f1']:.3f}",
                      _lat(row["detect_latency_steps"]), _lat(row["ban_latency_steps"]),
                      f"{row['val_loss_attacked_verified']:.3f}", f"{row['val_loss_attacked_unverified']:.3f}",
                      f"{row['damage_unverified']:+.3f}")
    console = Console()
    console.print(table)
    clean, over = report["clean"], report["overhead"]
    console.print(f"clean runs: FPR {clean['fpr']:.4f} ({clean['blamed_pairs']}/{clean['pairs']} (step, sender) "
                  f"pairs), bans {clean['banned']}, val loss {clean['val_loss']:.3f}")
    for row in report.get("clean_wide", []):
        console.print(_wide_line(row))
    console.print(f"emulated step (CPU): {over['step_ms_verify_on']:.1f} ms verified vs "
                  f"{over['step_ms_verify_off']:.1f} ms unverified (+{100 * over['overhead']:.1f}%, "
                  f"{over['us_per_check']:.0f} us per check; serial, gpt-tiny)")
    for row in over["at_width"]:
        console.print(f"  d_model {row['d_model']:4d}, {row['layers_per_stage']} layers/stage, "
                      f"{row['microbatch']}x{row['seq']} tokens: stage fwd+bwd {row['stage_fwd_bwd_ms']:.1f} ms, "
                      f"its two checks {row['checks_ms']:.2f} ms ({100 * row['overhead']:.1f}%)")
    for row in over["distributed"] + over.get("distributed_emulated", []):
        slowed = f" (compute emulated {row['slowdown']:g}x slower)" if row.get("slowdown", 1.0) != 1.0 else ""
        console.print(f"  stagewise run{slowed}, {row['model']}, verifier on {row['verifier']}: step "
                      f"{row['step_ms_verify_on']:.1f} vs {row['step_ms_verify_off']:.1f} ms "
                      f"({100 * row['overhead']:+.1f}% wall), CPU {row['cpu_ms_verify_on']:.0f} vs "
                      f"{row['cpu_ms_verify_off']:.0f} ms ({100 * row['cpu_overhead']:+.1f}%), {row['runs']} run(s) each")
    goals = report["goals"]
    console.print(f"goals: F1 >= {GOALS['f1']} on every attack: {goals['f1_all']}; FPR <= {GOALS['fpr']}: "
                  f"{goals['fpr']}; overhead <= {GOALS['overhead']}: widest emulated stage {goals['overhead']}, "
                  f"distributed {goals['overhead_distributed']}; FPR at width {goals.get('fpr_wide', {})}")


def _lat(values: list[int | None]) -> str:
    return ",".join("-" if v is None else str(v) for v in values)


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
                       "fpr_wide": {_wide_key(r): r["fpr"] <= GOALS["fpr"]
                                    for r in report["clean_wide"]},
                       "overhead": report["overhead"]["at_width"][-1]["overhead"] <= GOALS["overhead"],
                       "overhead_distributed": distributed_goals(report["overhead"]["distributed"]),
                       **{k: v for k, v in old.get("goals", {}).items() if k == "overhead_distributed_emulated"}}
    report["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__,
                         "note": "timings on a shared, loaded machine are noisy"}
    print_table(report)
    if out is not None:
        _write(report, out)
    return 0


def only_contributions(out: Path | None, *, widths: tuple[int, ...]) -> int:
    """Time the replicas' contribution checks alone (:func:`contribution_cost`) and merge them into the report
    at ``out`` as ``overhead.contributions`` (goal: <= 5% of a replica's step at d >= 384)."""
    rows = contribution_cost(widths)
    for r in rows:
        print(f"  contributions d={r['d_model']}: replica step {r['replica_step_compute_ms']} ms, sketch "
              f"{r['sketch_ms']} ms ({r['overhead']:+.1%}), judge {r['judge_ms']} ms, robust sum "
              f"{r['robust_sum_ms']} ms ({r['overhead_robust']:+.1%} with it)", flush=True)
    if out is None:
        return 0
    report = json.loads(out.read_text()) if out.exists() else {"overhead": {}, "goals": {}}
    report["overhead"]["contributions"] = rows
    report.setdefault("goals", {})["overhead_contributions"] = all(
        r["overhead"] <= GOALS["overhead"] for r in rows if r["d_model"] >= 384)
    _write(report, out)
    return 0


def distributed_goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    return {f"{r['model']} / {r['verifier']}": r["overhead"] <= GOALS["overhead"] for r in rows}


def only_overhead(out: Path | None, *, reps: int, models: list[str], wait_first: bool, slowdown: float = 1.0,
                  steps: int | None = None) -> int:
    """Rerun the distributed overhead alone and merge it into the report at ``out`` (the
    detection results there are kept; None: nothing written); records how long it took and the machine's load.
    With a ``slowdown`` the rows go to ``distributed_emulated`` (see :func:`distributed_overhead`).
    ``steps``: steps per run instead of each model's own (a smoke run)."""
    load_before, t0 = os.getloadavg(), time.perf_counter()
    chosen = {m: OVERHEAD_MODELS[m][:2] + (steps or OVERHEAD_MODELS[m][2],) for m in models}
    rows = distributed_overhead(chosen, reps=reps, wait_first=wait_first, slowdown=slowdown)
    duration_s = time.perf_counter() - t0
    report = json.loads(out.read_text()) if out is not None and out.exists() else {"overhead": {}, "goals": {}}
    section = "distributed" if slowdown == 1.0 else "distributed_emulated"
    # Rows of the models not rerun stay; the rerun ones replace theirs (in OVERHEAD_MODELS' order).
    kept = [r for r in report["overhead"].get(section, []) if r["model"] not in models]
    order = list(OVERHEAD_MODELS)
    merged = sorted(kept + rows, key=lambda r: (order.index(r["model"]) if r["model"] in order else len(order),
                                                 r["verifier"] != "stage rank 0"))
    report["overhead"][section] = merged
    runs = report["overhead"].get(f"{section}_runs", {})
    runs = runs if isinstance(runs, dict) else {}
    for model in models:
        runs[model] = {"models_in_run": models, "duration_s": round(duration_s, 1), "reps": reps,
                       "wait_first": wait_first, "slowdown": slowdown,
                       "load_avg_before": [round(x, 2) for x in load_before],
                       "load_avg_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    report["overhead"][f"{section}_runs"] = runs
    report["overhead"]["distributed_note"] = (
        "`stagewise run`, 4 stage ranks (+ a verifier host) on 2 shared cores: the checks' CPU time cannot hide "
        "behind compute here, so wall and CPU overhead are reported separately; cpu_ms is summed over ranks. "
        "distributed_emulated: every stage's compute emulated `slowdown` times slower than this CPU (its core "
        "idles meanwhile, as a GPU's host CPU does), the checks free to overlap it")
    report.setdefault("goals", {})[f"overhead_{section}"] = distributed_goals(merged)
    for row in rows:
        print(f"stagewise run, {row['model']}, verifier on {row['verifier']}: step {row['step_ms_verify_on']:.1f} vs "
              f"{row['step_ms_verify_off']:.1f} ms ({100 * row['overhead']:+.1f}% wall), CPU "
              f"{row['cpu_ms_verify_on']:.0f} vs {row['cpu_ms_verify_off']:.0f} ms ({100 * row['cpu_overhead']:+.1f}%)"
              + (f"; waiting first {row['step_ms_wait_first']:.1f} ms ({100 * row['overhead_wait_first']:+.1f}% "
                 f"wall, {100 * row['cpu_overhead_wait_first']:+.1f}% CPU)" if "step_ms_wait_first" in row else ""))
    print(f"took {duration_s:.0f} s; load average before {load_before}, after {os.getloadavg()}")
    if out is not None:
        _write(report, out)
    return 0


def only_clean_wide(out: Path | None, *, wide: dict[str, Any]) -> int:
    """Rerun the wide clean runs alone and merge them into the report at ``out`` (its other
    sections are kept; None: nothing written)."""
    rows = wide_clean(**wide)
    report = json.loads(out.read_text()) if out is not None and out.exists() else {}
    report["clean_wide"] = rows
    report.setdefault("goals", {})["fpr_wide"] = {_wide_key(r): r["fpr"] <= GOALS["fpr"]
                                                  for r in rows}
    for row in rows:
        print(_wide_line(row))
    if out is not None:
        _write(report, out)
    return 0


def _wide_line(row: dict[str, Any]) -> str:
    return (f"clean runs, {row['model']}, lr {row['lr']:g} (warm-up {row.get('lr_warmup', 0)}), {row['steps']} "
            f"steps, seeds {row.get('seeds', [row.get('seed', 0)])}: FPR {row['fpr']:.4f} "
            f"({row['blamed_pairs']}/{row['pairs']}; per seed {row.get('fpr_per_seed', [row['fpr']])}), "
            f"bans {row['banned']}, "
            f"flags {row['flags_by_test']}")


def _wide_key(row: dict[str, Any]) -> str:
    return f"d={row['d_model']} lr={row['lr']:g} lr warm-up {row.get('lr_warmup', 0)}"


def _write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(main())
