"""The reference a resumed run is compared with: the whole model in one process, its parameters and
optimizer state read by hand from a checkpoint's rank files, trained for the remaining steps."""
from __future__ import annotations

import shutil

import torch
from safetensors import safe_open

from models.registry import build_model, loss_fn
from planner.runtime.data import make_source
from planner.runtime.launcher import elastic
from planner.runtime.launcher.launch import launch
from planner.runtime.rank.rank_setup import make_optimizer
from planner.runtime.recovery import checkpoint
from planner.secret import run_secret


def from_checkpoint_by_hand(root, step: int, plan, steps: int) -> dict[str, torch.Tensor]:
    """The whole model in this process: parameters and Adam state read from the checkpoint's rank files
    by name, then steps ``step + 1 .. steps - 1`` on ``plan``'s batch (its microbatches accumulated)."""
    cfg = plan.config
    bundle = build_model(plan.model.spec, batch=cfg.microbatch_size, seq=plan.model.seq, device="cpu", seed=0)
    model = bundle.module
    named = dict(model.named_parameters())
    loaded = checkpoint.read_params(root, step=step, names=named, key=run_secret())
    assert loaded.keys() == named.keys()
    with torch.no_grad():
        for n, t in loaded.items():
            named[n].copy_(t)
    opt = make_optimizer(cfg.optimizer, list(named.values()), lr=None)
    for path in checkpoint.rank_files(root, step=step):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith("optim/"):
                    name, _, k = key.removeprefix("optim/").rpartition("/")
                    opt.state[named[name]][k] = f.get_tensor(key)
    assert len(opt.state) == len(named)
    source, loss_of = make_source(bundle, seq=plan.model.seq, seed=0), loss_fn(bundle)
    for s in range(step + 1, steps):
        inputs, targets = source.batch(s, cfg.global_batch)
        for lo in range(0, cfg.global_batch, cfg.microbatch_size):
            hi = lo + cfg.microbatch_size
            (loss_of(model(*(t[lo:hi] for t in inputs)), targets[lo:hi]) / plan.num_microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in named.items()}


def keep_resumed_checkpoints(monkeypatch, clean) -> list:
    """Make the re-planning launcher copy each checkpoint it resumes from into ``clean`` (pruning removes
    it later) before it resumes; returns the list it appends (step, options) to."""
    resumed: list = []

    def keeping(opts, **kwargs):
        if opts.resume:
            step = checkpoint.complete_steps(opts.checkpoint_dir)[-1]
            shutil.copytree(checkpoint.step_folder(opts.checkpoint_dir, step), checkpoint.step_folder(clean, step))
            resumed.append((step, opts))
        return launch(opts, **kwargs)

    monkeypatch.setattr(elastic, "launch", keeping)
    return resumed
