"""The pipelined run equals the unpipelined model: loss, gradients on every rank, and weights after
several optimizer steps (gloo on CPU, one process per rank, each with one thread).

Parametrized economically: every preset, 2 and 4 ranks, uneven stages, GPipe and 1F1B, SGD and
Adam, a replicated stage, a weight tied across stages, a learning-rate warm-up and stages that
recompute their activations, without the full cross product.
"""
from __future__ import annotations

import pytest
import torch

from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from tests.dist.plans import load_dumps, make_plan, reference_run

torch.set_num_threads(1)

CASES = {
    # name: (spec, seq, microbatch, M, stages, replicas, schedule, optimizer, steps)
    "gpt-2ranks-1f1b-uneven-sgd": ("gpt-tiny", 16, 2, 4, [(0, 1), (2, 5)], None, "1f1b", "sgd", 3),
    "llama-4ranks-gpipe-adam": ("llama-tiny", 16, 1, 4, [(0, 1), (2, 2), (3, 3), (4, 5)], None, "gpipe", "adam", 2),
    "mlp-2ranks-gpipe-adam": ("mlp-tiny", None, 2, 3, [(0, 3), (4, 5)], None, "gpipe", "adam", 3),
    "cnn-4ranks-1f1b-sgd": ("cnn-tiny", None, 2, 4, [(0, 0), (1, 1), (2, 2), (3, 4)], None, "1f1b", "sgd", 2),
    "gpt-3ranks-replicated-adam": ("gpt-tiny", 16, 2, 4, [(0, 2), (3, 5)], {1: (2, 2)}, "1f1b", "adam", 3),
    # embedding tied to the LM head: the first and last stage sum that weight's gradients
    "tied-gpt-2ranks-1f1b-adam": ("tests.dist.plans:tied_gpt", 16, 2, 2, [(0, 1), (2, 3)], None, "1f1b", "adam", 2),
    # activation recomputation: the checkpointed stages compute the same gradients
    "llama-3ranks-recompute-adam": ("llama-tiny", 16, 1, 4, [(0, 1), (2, 3), (4, 5)], None, "1f1b", "adam", 2),
    "gpt-3ranks-replicated-recompute-sgd": ("gpt-tiny", 16, 2, 4, [(0, 2), (3, 5)], {1: (2, 2)}, "1f1b", "sgd", 2),
}
RECOMPUTE = {"llama-3ranks-recompute-adam": (0, 1), "gpt-3ranks-replicated-recompute-sgd": (0, 1)}
LR_WARMUP = {"mlp-2ranks-gpipe-adam": 2}  # steps of linear warm-up (`--lr-warmup`): rates 1/2, 1, 1


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_single_process_reference(case, tmp_path):
    spec, seq, mbs, m, stages, replicas, schedule, optimizer, steps = CASES[case]
    plan = make_plan(spec, microbatch=mbs, num_microbatches=m, seq=seq, stages=stages, replicas=replicas,
                     schedule=schedule, optimizer=optimizer, recompute=RECOMPUTE.get(case, ()))
    assert [st.recompute for st in plan.stages] == [k in RECOMPUTE.get(case, ()) for k in range(len(stages))]
    path = plan.save(tmp_path / "plan.json")
    warmup = LR_WARMUP.get(case, 0)
    factory = spec if ":" in spec else None  # the test names the factory it trusts, as a user would (--model)
    result = launch(RunOptions(plan=str(path), steps=steps, timeout_s=60, dump=str(tmp_path / "dump"),
                               lr_warmup=warmup, model=factory))
    losses, grads, params = reference_run(plan, steps=steps, lr_warmup=warmup)

    assert result["steps"] == steps and len(result["step_ms"]) == steps
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    dumps = load_dumps(tmp_path / "dump", plan.num_ranks)
    last = [d for d in dumps if d["stage"] == plan.num_stages - 1]
    per_step = torch.tensor([sum(d["losses"][s] for d in last) for s in range(steps)])
    torch.testing.assert_close(per_step, torch.tensor(losses), rtol=1e-5, atol=1e-6)
    covered = set()
    for d in dumps:
        assert d["grads"], f"rank {d['rank']} dumped no gradients"
        for name, g in d["grads"].items():  # last step's gradients, after any all-reduce
            torch.testing.assert_close(g, grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # Weights after `steps` optimizer steps. Adam moves every element by about lr whatever the gradient's
        # size, so an element whose true gradient is 0 (a key bias) moves by rounding noise: atol 1e-5 allows
        # that noise and still catches any real error (which moves many elements by ~lr = 1e-3).
        for name, p in d["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        covered |= set(d["params"])
    # every parameter of the model is on some rank (a tied one under either of its names)
    assert {id(params[n]) for n in covered} == {id(p) for p in params.values()}
