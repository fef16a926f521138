"""The detection benchmark's single-process emulation of a 4-stage gpt-tiny pipeline (``verification.py``): the
runtime's attack and verification calls on every boundary tensor, and one emulated training run."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from models.data import ByteTextDataset
from models.registry import PRESETS, lm_loss
from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.verifier import Verifier
from planner.runtime.rank.rank_setup import make_lr_warmup
from planner.verifier_config import VerifierConfig

__all__ = ["ATTACKER", "Pipeline", "RunConfig", "RunResult", "plan_default_config", "run", "split_stages",
           "wide_tiny"]

ATTACKER = 1


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
