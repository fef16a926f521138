"""AdamW with weight decay, a warm-up then a cosine schedule, and clipping to a global gradient norm: the
pipelined run equals a single-process torch loop built from torch's own classes (``torch.optim.AdamW``,
``LinearLR`` then ``CosineAnnealingLR``, ``clip_grad_norm_``), on 2 and 3 stages, a replicated stage with
a verifier-only rank, and a weight tied across stages (each counted once in the global norm); and a run
that dies mid-schedule and resumes ends where an unbroken one does.
"""
from __future__ import annotations

import math

import pytest
import torch

from planner.errors import RankFailureError
from planner.runtime.launcher.launch import launch
from planner.runtime.options import FaultSpec, RunOptions
from tests.dist.plans import load_dumps, make_plan

torch.set_num_threads(1)

LR, WEIGHT_DECAY, CLIP, WARMUP, STEPS = 1e-2, 0.1, 0.05, 2, 4
CASES = {
    # name: (spec, seq, microbatch, M, stages, replicas, verifiers)
    "mlp-2stages": ("mlp-tiny", None, 2, 3, [(0, 3), (4, 5)], None, ()),
    # a replicated middle stage (its replicas hold one summed gradient) and a verifier-only rank
    "gpt-3stages-replicated-verified": ("gpt-tiny", 16, 2, 4, [(0, 1), (2, 3), (4, 5)], {1: (2, 2)},
                                        [(0, 4, ("act",))]),
    # the embedding tied to the LM head: held by both stages, counted once
    "tied-gpt-2stages": ("tests.dist.plans:tied_gpt", 16, 2, 2, [(0, 1), (2, 3)], None, ()),
}


def torch_reference(plan, *, steps: int):
    """The whole model on the global batch (gradient accumulation over the plan's microbatches), stepped
    by torch's AdamW, warm-up and cosine schedulers and clip_grad_norm_. Returns (losses, the last step's
    clipped gradients and the parameters after it, by name, and the unclipped global norm of each step)."""
    from models.registry import build_model, loss_fn
    from planner.runtime.data import make_source

    ref = plan.model
    bundle = build_model(ref.spec, batch=plan.config.microbatch_size, seq=ref.seq, device="cpu", seed=0)
    model, source, loss_of = bundle.module, make_source(bundle, seq=ref.seq, seed=0), loss_fn(bundle)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - WARMUP)
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[WARMUP])
    losses, norms, mbs = [], [], plan.config.microbatch_size
    for step in range(steps):
        inputs, targets = source.batch(step, plan.config.global_batch)
        total = 0.0
        for lo in range(0, plan.config.global_batch, mbs):
            loss = loss_of(model(*(t[lo:lo + mbs] for t in inputs)), targets[lo:lo + mbs]) / plan.num_microbatches
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
    clones: dict[int, torch.Tensor] = {}  # aliases of a tied parameter share one clone (compare by id)
    params = {n: clones.setdefault(id(p), p.detach().clone())
              for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, grads, params, norms


@pytest.mark.parametrize("case", list(CASES))
def test_adamw_cosine_clipping_match_torch(case, tmp_path):
    spec, seq, mbs, m, stages, replicas, verifiers = CASES[case]
    plan = make_plan(spec, microbatch=mbs, num_microbatches=m, seq=seq, stages=stages, replicas=replicas,
                     optimizer="adamw", verifiers=verifiers, verifier_host=bool(verifiers))
    path = plan.save(tmp_path / "plan.json")
    factory = spec if ":" in spec else None
    result = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp_path / "dump"), model=factory,
                               lr=LR, weight_decay=WEIGHT_DECAY, lr_warmup=WARMUP, lr_schedule="cosine",
                               clip_grad=CLIP))
    losses, grads, params, norms = torch_reference(plan, steps=STEPS)

    assert all(n > CLIP for n in norms), f"the case must clip every step to test clipping: norms {norms}"
    assert all(math.isfinite(x) for x in result["losses"])
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    covered = set()
    for d in load_dumps(tmp_path / "dump", plan.num_ranks):
        for name, g in d["grads"].items():  # clipped by the global norm: a norm counted wrong scales them all
            torch.testing.assert_close(g, grads[name], rtol=1e-4, atol=1e-7, msg=lambda msg: f"{name}: {msg}")
        # Adam moves an element whose true gradient is 0 (a key bias) by rounding noise, a fraction of LR: atol
        # 1e-4 (1% of LR) allows that and still catches a real error, which moves many elements by ~LR.
        for name, p in d["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-4, atol=1e-4, msg=lambda msg: f"{name}: {msg}")
        covered |= set(d["params"])
    assert {id(params[n]) for n in covered} == {id(p) for p in params.values()}  # every parameter on some rank


def test_a_run_resumed_mid_schedule_ends_where_an_unbroken_one_does(tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 3), (4, 5)], optimizer="adamw")
    path = plan.save(tmp_path / "plan.json")

    def opts(**kw) -> RunOptions:
        return RunOptions(plan=str(path), steps=STEPS, timeout_s=30, lr=LR, weight_decay=WEIGHT_DECAY,
                          lr_warmup=WARMUP, lr_schedule="cosine", clip_grad=CLIP, **kw)

    launch(opts(dump=str(tmp_path / "straight")))
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RankFailureError):  # dies after the checkpoint of step 1, as the cosine starts
        launch(opts(checkpoint_dir=ckpt, checkpoint_every=1, fault=FaultSpec(rank=1, kind="die", step=2)))
    result = launch(opts(checkpoint_dir=ckpt, resume=True, dump=str(tmp_path / "resumed")))
    assert result["steps"] == STEPS - 2
    straight, resumed = ({n: p for d in load_dumps(tmp_path / f, plan.num_ranks) for n, p in d["params"].items()}
                         for f in ("straight", "resumed"))
    assert set(resumed) == set(straight)
    for name, p in resumed.items():
        torch.testing.assert_close(p, straight[name], msg=lambda msg: f"{name}: {msg}")
