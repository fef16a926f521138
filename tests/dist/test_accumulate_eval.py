"""Gradient accumulation and validation passes against a single-process torch loop.

``--accumulate K``: K pipeline passes per optimizer step, each on its own batch, equal one SGD step
(weight decay, warm-up then cosine; SGD without clipping, so a gradient summed instead of averaged
shows) on the K passes' batches together, on 2 stages and on 3 with a replicated stage. ``--eval-data``: the validation loss the run reports equals the trained model's forward on the
validation batch, and validating changes nothing of the training.
"""
from __future__ import annotations

import pytest
import torch

from planner.runtime.data import EVAL_STEP
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.runtime.rank.rank_setup import lr_factor
from tests.dist.plans import load_dumps, make_plan

torch.set_num_threads(1)

LR, WEIGHT_DECAY, WARMUP, STEPS, K = 0.05, 0.1, 2, 4, 3
CASES = {
    # name: (spec, seq, microbatch, M, stages, replicas)
    "mlp-2stages": ("mlp-tiny", None, 2, 2, [(0, 3), (4, 5)], None),
    "gpt-3stages-replicated": ("gpt-tiny", 16, 2, 4, [(0, 1), (2, 3), (4, 5)], {1: (2, 2)}),
}


def _whole_model(plan):
    from models.registry import build_model, loss_fn
    from planner.runtime.data import make_source

    ref = plan.model
    bundle = build_model(ref.spec, batch=plan.config.microbatch_size, seq=ref.seq, device="cpu", seed=0)
    return bundle.module, make_source(bundle, seq=ref.seq, seed=0), loss_fn(bundle)


def accumulated_reference(plan, *, steps: int, accumulate: int):
    """Each optimizer step on the batches of its ``accumulate`` passes (pass ``s * K + k``), their
    microbatches' mean loss; torch's SGD, LinearLR then CosineAnnealingLR. Returns the losses, the last
    step's gradients and the parameters after it, by name."""
    model, source, loss_of = _whole_model(plan)
    opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - WARMUP)
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[WARMUP])
    cfg, losses = plan.config, []
    for step in range(steps):
        total = 0.0
        for k in range(accumulate):
            inputs, targets = source.batch(step * accumulate + k, cfg.global_batch)
            for lo in range(0, cfg.global_batch, cfg.microbatch_size):
                hi = lo + cfg.microbatch_size
                loss = loss_of(model(*(t[lo:hi] for t in inputs)), targets[lo:hi]) / (plan.num_microbatches
                                                                                      * accumulate)
                loss.backward()
                total += float(loss.detach())
        losses.append(total)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_accumulating_k_passes_equals_one_step_on_a_k_times_larger_batch(case, tmp_path):
    spec, seq, mbs, m, stages, replicas = CASES[case]
    plan = make_plan(spec, microbatch=mbs, num_microbatches=m, seq=seq, stages=stages, replicas=replicas,
                     optimizer="sgd")
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp_path / "dump"), lr=LR,
                               weight_decay=WEIGHT_DECAY, lr_warmup=WARMUP, lr_schedule="cosine", accumulate=K))
    losses, grads, params = accumulated_reference(plan, steps=STEPS, accumulate=K)

    assert result["accumulate"] == K and result["steps"] == STEPS
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    covered = set()
    for d in load_dumps(tmp_path / "dump", plan.num_ranks):
        for name, g in d["grads"].items():  # the passes' mean, summed over the replicas
            torch.testing.assert_close(g, grads[name], rtol=1e-4, atol=1e-7, msg=lambda msg: f"{name}: {msg}")
        for name, p in d["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-4, atol=1e-6, msg=lambda msg: f"{name}: {msg}")
        covered |= set(d["params"])
    assert covered == set(params)
    # One step of the schedule per optimizer step (not per pass): warm-up at LR, then cosine.
    factors = [lr_factor(s, warmup=WARMUP, schedule="cosine", total_steps=STEPS) for s in range(STEPS)]
    assert result["lr"] == pytest.approx([LR * f for f in factors])


def test_validation_loss_is_the_trained_models_forward_and_changes_no_training(tmp_path):
    # a replicated last stage (the validation microbatches follow the plan's routing) and a verifier-only
    # rank, with verification on: it checks training sends only
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=3, stages=[(0, 3), (4, 5)], replicas={1: (1, 2)},
                     verifiers=[(0, 3, ("act",))], verifier_host=True)
    path = plan.save(tmp_path / "plan.json")

    def run(name: str, **kw):
        return launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp_path / name), **kw))

    plain = run("plain")
    evaluated = run("evaluated", eval_data="synthetic", eval_every=2, metrics=str(tmp_path / "m.jsonl"))

    assert evaluated["losses"] == plain["losses"]  # forward only, in eval mode, under no_grad
    assert evaluated["flags"] == 0 and not evaluated["banned"] and evaluated["verified_boundaries"] == [0]
    assert [e["step"] for e in evaluated["eval_losses"]] == [1, STEPS - 1]  # every 2 steps, and after the last
    model, source, loss_of = _whole_model(plan)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for d in load_dumps(tmp_path / "evaluated", plan.num_ranks):
            for n, p in d["params"].items():
                named[n].copy_(p)
        inputs, targets = source.batch(EVAL_STEP, plan.config.global_batch)
        mbs = plan.config.microbatch_size
        by_hand = [float(loss_of(model(*(t[lo:lo + mbs] for t in inputs)), targets[lo:lo + mbs]))
                   for lo in range(0, plan.config.global_batch, mbs)]
    assert evaluated["final_eval_loss"] == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-5)
    assert evaluated["eval_losses"][0]["loss"] != evaluated["final_eval_loss"]  # trained in between

    import json
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    per_step = {r["step"]: r for r in rows if r["rank"] == 0}
    assert [per_step[s]["loss"] for s in range(STEPS)] == pytest.approx(evaluated["losses"], rel=1e-5)
    assert {s for s, r in per_step.items() if "eval_loss" in r} == {1, STEPS - 1}
    assert per_step[STEPS - 1]["eval_loss"] == pytest.approx(evaluated["final_eval_loss"], rel=1e-5)


def test_the_python_driver_validates_and_accumulates(tmp_path):
    import planner

    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 3), (4, 5)])
    out = planner.train(plan, steps=2, data="synthetic", eval_data="synthetic", accumulate=2, timeout_s=60)
    assert len(out.losses) == 2 and out.result["accumulate"] == 2
    assert [step for step, _ in out.eval_losses] == [1] and out.eval_losses[0][1] > 0
