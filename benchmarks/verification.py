"""Detection benchmark of the integrity monitors (SENTINEL-style verification).

Runs real training of a byte-level GPT (gpt-tiny on the stdlib sources,
``models.data.ByteTextDataset``) as a 4-stage pipeline *emulated in one
process*: each stage is a slice of the model, every boundary tensor goes
through exactly the calls the distributed runtime makes (``Attacker.apply`` by
the sending rank, ``Verifier.check`` on the verifier, ``Verifier.end_step``
with all flags of the step), a flagged microbatch is dropped, and a banned
rank is planned around (its stage is run honestly from then on). Rank r runs
stage r; boundary b sits between ranks b and b + 1; the attacker is a middle
stage.

Reported per attack: precision, recall and F1 over (step, sender) pairs,
detection and ban latency in steps, the false-positive rate of clean runs,
final validation loss clean / attacked with and without verification, and
the step-time overhead of verification.

    python benchmarks/verification.py            # full table, writes benchmarks/results/verification.json
    python benchmarks/verification.py --quick    # fewer steps and seeds (a smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.data import ByteTextDataset  # noqa: E402
from models.registry import PRESETS, lm_loss  # noqa: E402
from planner.runtime.attacks import Attacker, parse_attack  # noqa: E402
from planner.runtime.verify import Verifier, blame  # noqa: E402

# The 7 single attacks the runtime tests ban, plus the two composite ones.
ATTACKS: dict[str, str] = {
    "constant": "kind=constant,dir=act",
    "zeros": "kind=zeros,dir=act",
    "random": "kind=random,dir=act",
    "scale-1": "kind=scale,factor=-1,dir=act",
    "grad-sign-flip": "kind=sign_flip,dir=grad",
    "random-sign": "kind=random_sign,dir=grad",
    "delay": "kind=delay,steps=2,dir=act",
    "bias": "kind=bias,dir=act",
    "noise": "kind=noise,dir=act",
    "noise-grad": "kind=noise,dir=grad",
    "mixed": "kind=mixed,dir=both",
    "adaptive": "kind=adaptive,dir=act",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulationConfig:
    """One emulated training run."""

    steps: int = 60
    stages: int = 4
    microbatches: int = 4
    microbatch_size: int = 4
    seq: int = 32
    lr: float = 1e-3
    seed: int = 0
    attack: str | None = None      # attack spec without rank; the attacker is `attacker_rank`
    attacker_rank: int = 1
    attack_start: int = 20
    verify: bool = True
    verifier_config: dict = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class RunResult:
    losses: list[float]
    val_loss: float
    step_ms: list[float]
    blamed: dict[int, list[int]]          # step -> blamed senders
    attacked_steps: list[int]             # steps where the attacker corrupted a tensor
    ban_step: int | None
    banned: list[int]
    checks: int


def split_stages(model: torch.nn.Module, stages: int) -> list[torch.nn.Module]:
    """Contiguous stages: embed + first layers ... last layers + head, layers spread evenly."""
    layers = list(model.layers)
    if not 2 <= stages <= len(layers):
        raise ValueError(f"need 2..{len(layers)} stages, got {stages}")
    bounds = [round(i * len(layers) / stages) for i in range(stages + 1)]
    parts = []
    for s in range(stages):
        mods = ([model.embed] if s == 0 else []) + layers[bounds[s]:bounds[s + 1]]
        mods += [model.head] if s == stages - 1 else []
        parts.append(torch.nn.Sequential(*mods))
    return parts


def _boundaries(stages: int) -> list[tuple[int, str]]:
    return [(b, d) for b in range(stages - 1) for d in ("act", "grad")]


def _forward(stages, idx, *, step, mb, attacker, verifier):
    """Run one microbatch forward through the stages; None when a boundary flags it."""
    inputs, outputs, h = [], [], idx
    for s, stage in enumerate(stages):
        h_in = h if s == 0 else h.detach().requires_grad_(True)
        out = stage(h_in)
        inputs.append(h_in)
        outputs.append(out)
        if s == len(stages) - 1:
            break
        sent = out.detach()
        if attacker is not None and attacker.spec.rank == s:
            sent = attacker.apply(sent, direction="act", step=step, mb=mb)
        if verifier is not None and verifier.check(s, "act", sent, step=step, mb=mb, sender=s).tainted:
            return None
        h = sent
    return inputs, outputs


def _backward(stages, inputs, outputs, loss, *, step, mb, attacker, verifier) -> None:
    """Backward stage by stage; a flagged gradient is not passed further upstream."""
    grad = None
    for s in reversed(range(len(stages))):
        if s == len(stages) - 1:
            loss.backward()
        else:
            outputs[s].backward(grad)
        if s == 0:
            return
        g = inputs[s].grad
        if attacker is not None and attacker.spec.rank == s:
            g = attacker.apply(g, direction="grad", step=step, mb=mb)
        if verifier is not None and verifier.check(s - 1, "grad", g, step=step, mb=mb, sender=s).tainted:
            return
        grad = g


def run_emulation(cfg: EmulationConfig) -> RunResult:
    torch.manual_seed(cfg.seed)
    preset = PRESETS["gpt-tiny"]
    model = preset.build()
    model.init_weights(cfg.seed)
    stages = split_stages(model, cfg.stages)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    train = ByteTextDataset(cfg.seq, "train")
    val_idx, val_tgt = ByteTextDataset(cfg.seq, "val").batch(0, 32, seed=cfg.seed + 1)
    verifier = Verifier(cfg.verifier_config, _boundaries(cfg.stages)) if cfg.verify else None
    attacker = None
    if cfg.attack:
        spec = parse_attack(f"rank={cfg.attacker_rank},start={cfg.attack_start},{cfg.attack}")
        attacker = Attacker(spec, seed=cfg.seed)
    the_attacker = attacker
    result = RunResult(losses=[], val_loss=float("nan"), step_ms=[], blamed={}, attacked_steps=[],
                       ban_step=None, banned=[], checks=0)
    m, bs = cfg.microbatches, cfg.microbatch_size
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        idx, tgt = train.batch(step, m * bs, seed=cfg.seed)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for mb in range(m):
            sl = slice(mb * bs, (mb + 1) * bs)
            fwd = _forward(stages, idx[sl], step=step, mb=mb, attacker=attacker, verifier=verifier)
            if fwd is None:
                continue  # dropped microbatch: it contributes nothing this step
            inputs, outputs = fwd
            loss = lm_loss(outputs[-1], tgt[sl]) / m
            step_loss += float(loss)
            _backward(stages, inputs, outputs, loss, step=step, mb=mb, attacker=attacker, verifier=verifier)
        if verifier is not None:
            before = set(verifier.banned)
            flags = verifier.flag_events(step)
            result.blamed[step] = sorted(blame(flags))
            banned = verifier.end_step(step, [flags])
            if attacker is not None and attacker.spec.rank in banned - before:
                result.ban_step = step
                attacker = None  # planned around: an honest device takes over the stage
        opt.step()
        result.step_ms.append((time.perf_counter() - t0) * 1e3)
        result.losses.append(step_loss)
    if the_attacker is not None:
        result.attacked_steps = sorted(the_attacker.attacked_steps())
    with torch.no_grad():
        h = val_idx
        for stage in stages:
            h = stage(h)
        result.val_loss = float(lm_loss(h, val_tgt))
    if verifier is not None:
        result.banned = sorted(verifier.banned)
        result.checks = sum(m_["checked"] for m_ in verifier.summary()["monitors"])
    return result
