"""Deferred verdicts (the executor computes with a received tensor before its verifier's verdict
arrives) give the results of waiting for the verdict first, bit for bit in practice:

* with no attack, a verified run trains exactly like an unverified one (loss, last gradients,
  parameters after several Adam steps), and
* with attackers whose corrupted microbatches get flagged in both directions (an infinite
  scale, which the monitors flag whatever their statistics), the run equals the same run with
  ``wait_verdicts=True`` (wait first): same drops, flags, losses, gradients, parameters.
  That covers a forward run again on zeros (a middle and the last stage), a held backward
  dropped (the first and a middle stage), kept ones merged, taint headers, a replicated stage
  (all-reduce) and a weight tied across stages.

Ranks are gloo processes with one thread; the verifier is a CPU-only host rank.
"""
from __future__ import annotations

import pytest
import torch

from planner.plan_load import load_plan
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.verifier_config import VerifierConfig
from tests.dist.plans import load_dumps, make_plan

M, STEPS = 4, 3
BOTH = ("act", "grad")

# name -> (make_plan kwargs, attacks of the attack test)
CASES = {
    "gpt-4stages": (dict(spec="gpt-tiny", seq=16, microbatch=2, stages=[(0, 1), (2, 2), (3, 3), (4, 5)],
                         verifiers=[(b, 4, BOTH) for b in range(3)]),
                    ("rank=1,kind=scale,factor=inf,start=1,p=0.15,dir=both",
                     "rank=2,kind=scale,factor=inf,start=1,p=0.15,dir=both")),
    # ranks: 0 = stage 0, 1-2 = stage 1's replicas, 3 = stage 2, 4 = verifier; embedding tied to the head
    "tied-replicated": (dict(spec="tests.dist.plans:tied_gpt", seq=16, microbatch=2, stages=[(0, 0), (1, 2), (3, 3)],
                             replicas={1: (2, 2)}, verifiers=[(0, 4, BOTH), (1, 4, BOTH)]),
                        ("rank=1,kind=scale,factor=inf,start=1,p=0.3,dir=both",
                         "rank=3,kind=scale,factor=inf,start=1,p=0.3,dir=grad",
                         "rank=0,kind=scale,factor=inf,start=2,p=0.2,dir=act")),
}


def _plan(tmp_path, case: str):
    kwargs, _ = CASES[case]
    plan = make_plan(**kwargs, num_microbatches=M, optimizer="adam", verifier_host=True,
                     verifier_config=VerifierConfig(warmup=1, ban_false_steps=1e12))
    assert plan.ranks[-1].stage is None, "the verifier is a host of its own"
    return plan, plan.save(tmp_path / "plan.json")


def _run(path, folder, *, verify: bool = True, attacks: tuple[str, ...] = (), wait: bool = False
         ) -> tuple[dict, list[dict]]:
    spec = load_plan(path).model.spec
    result = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=120, verify=verify, attacks=attacks,
                               dump=str(folder), wait_verdicts=wait, model=spec if ":" in spec else None))
    return result, load_dumps(folder, result["num_ranks"])


def _assert_same_training(got: list[dict], want: list[dict], *, rtol: float = 0.0, atol: float = 0.0) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["params"].keys() == w["params"].keys() and g["grads"].keys() == w["grads"].keys()
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(w["losses"]), rtol=rtol, atol=atol)
        for kind in ("params", "grads"):
            for name, value in w[kind].items():
                torch.testing.assert_close(g[kind][name], value, rtol=rtol, atol=atol,
                                           msg=lambda m: f"rank {w['rank']} {kind} {name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_verified_run_without_attack_trains_like_an_unverified_one(case, tmp_path):
    plan, path = _plan(tmp_path, case)
    on, on_dumps = _run(path, tmp_path / "on")
    off, off_dumps = _run(path, tmp_path / "off", verify=False)
    assert on["flags"] == 0 and on["dropped"] == [0] * STEPS, "a false positive would make the runs differ"
    assert on["losses"] == off["losses"]
    _assert_same_training(on_dumps, off_dumps)


@pytest.mark.parametrize("case", list(CASES))
def test_deferred_verdicts_drop_what_waiting_first_drops(case, tmp_path):
    plan, path = _plan(tmp_path, case)
    _, attacks = CASES[case]
    deferred, deferred_dumps = _run(path, tmp_path / "deferred", attacks=attacks)
    waited, waited_dumps = _run(path, tmp_path / "waited", attacks=attacks, wait=True)

    # the attacks did bite, in both directions, and some microbatches of an attacked step survived
    attacked = [tuple(e) for r in deferred["ranks"] for e in r["attacked"]]
    assert {e[2] for e in attacked} == {"act", "grad"}
    assert deferred["flags"] > 0
    assert any(0 < d < M for d in deferred["dropped"]), deferred["dropped"]

    assert attacked == [tuple(e) for r in waited["ranks"] for e in r["attacked"]]
    for key in ("dropped", "flags", "losses", "banned"):
        assert deferred[key] == waited[key], key
    _assert_same_training(deferred_dumps, waited_dumps)
    for d in deferred_dumps:   # nothing corrupted reached a parameter
        assert all(torch.isfinite(p).all() for p in d["params"].values()), d["rank"]
