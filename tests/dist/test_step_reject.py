"""A step the verifiers reject (a winning step-level flag) trains nothing on any rank: the optimizer update
that ``OPTIM`` defers in a verified run is skipped everywhere, its gradients discarded, while every other
step trains exactly as before.

Three gloo processes, one thread each, run ``worker.run_rank`` directly (not through the launcher, so the
test can reach into them): a 2-stage GPT whose embedding is tied to its head across the stages (ranks 0
and 1) and a verifier host (rank 2) checking boundary 0 both ways. On the verifier rank a step-level flag
against rank 1's gradients is added to step ``REJECT``'s flags (what ``Monitor.close`` gives when a
sender's step as a whole fails, e.g. gradients scaled by 3); each rank saves its parameters and Adam
state after every step.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from planner.integrity.blame import STEP_MB
from planner.integrity.verifier import Verifier
from planner.runtime.executor import Executor
from planner.runtime.hosts import LOCAL_RUN_ENV
from planner.runtime.launch import free_port
from planner.runtime.options import RunOptions
from planner.runtime.rank_setup import RankEnv
from planner.verifier_config import VerifierConfig
from tests.dist.plans import make_plan

M, STEPS, REJECT = 4, 3, 1
SPEC = "tests.dist.plans:tied_gpt"
STAGE_RANKS, VERIFIER, SENDER = (0, 1), 2, 1   # rank 1 sends boundary 0's gradients


def _flag_step(step: int) -> None:
    """Make the verifiers' flags of ``step`` hold a step-level flag against ``SENDER``'s gradients."""
    original = Verifier.flag_events

    def flag_events(self: Verifier, at: int) -> list[dict]:
        flags = original(self, at)
        if at != step:
            return flags
        event = self._event("flag", self.monitor(0, "grad"), at, STEP_MB, SENDER, {}, ("injected",),
                            per_sample=False)
        self.events.append(event)
        return [*flags, event]

    Verifier.flag_events = flag_events


def _save_states(rank: int, out: Path) -> None:
    """After each step, this rank's parameters and optimizer state in ``out/rank{rank}-step{step}.pt``."""
    original = Executor.run_step

    def run_step(self: Executor, step: int, *args):
        metrics = original(self, step, *args)
        named = dict(self.stage.parameters()) if self.stage is not None else {}
        names = {id(p): n for n, p in named.items()}
        state = {f"param/{n}": p.detach().clone() for n, p in named.items()}
        for p, kept in (self.optimizer.state.items() if self.optimizer is not None else ()):
            state.update({f"optim/{names[id(p)]}/{k}": torch.as_tensor(v).clone() for k, v in kept.items()})
        torch.save(state, out / f"rank{rank}-step{step}.pt")
        return metrics

    Executor.run_step = run_step


def _rank(rank: int, world: int, port: int, plan: str, out: str, reject: int | None) -> None:
    from planner.runtime.worker import run_rank

    os.environ.update({LOCAL_RUN_ENV: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if reject is not None:
        _flag_step(reject)
    _save_states(rank, Path(out))
    result = run_rank(RunOptions(plan=plan, steps=STEPS, timeout_s=120, model=SPEC),
                      RankEnv(rank=rank, world_size=world, local_rank=rank))
    if result is not None:
        (Path(out) / "result.json").write_text(json.dumps(result))


def _run(plan_path: Path, out: Path, reject: int | None) -> tuple[dict, dict[tuple[int, int], dict]]:
    """Rank 0's result and every stage rank's state after each step, keyed by (rank, step)."""
    out.mkdir()
    mp.spawn(_rank, args=(VERIFIER + 1, free_port(), str(plan_path), str(out), reject), nprocs=VERIFIER + 1)
    states = {(r, s): torch.load(out / f"rank{r}-step{s}.pt") for r in STAGE_RANKS for s in range(STEPS)}
    return json.loads((out / "result.json").read_text()), states


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rejected_step_updates_nothing_on_any_rank_and_the_others_train_as_before(tmp_path):
    plan = make_plan(SPEC, seq=16, microbatch=2, num_microbatches=M, stages=[(0, 1), (2, 3)], optimizer="adam",
                     verifiers=[(0, VERIFIER, ("act", "grad"))], verifier_host=True,
                     verifier_config=VerifierConfig(warmup=1, ban_false_steps=1e12))
    assert plan.ranks[VERIFIER].stage is None and plan.num_ranks == VERIFIER + 1
    path = plan.save(tmp_path / "plan.json")
    clean, before = _run(path, tmp_path / "clean", reject=None)
    got, after = _run(path, tmp_path / "rejected", reject=REJECT)

    assert clean["flags"] == 0 and clean["dropped"] == [0] * STEPS and clean["rejected_steps"] == []
    assert got["rejected_steps"] == [REJECT] and got["banned"] == [] and got["untrained_steps"] == []
    assert got["dropped"] == [M if s == REJECT else 0 for s in range(STEPS)]   # every microbatch of it
    assert got["losses"][REJECT] is None and got["losses"][:REJECT] == clean["losses"][:REJECT]
    for r in STAGE_RANKS:
        assert any(k.startswith("optim/") for k in after[r, 0]), "Adam keeps state"
        for s in range(REJECT):                               # the steps before it trained as they did
            assert _same(after[r, s], before[r, s]), (r, s)
        assert not _same(before[r, REJECT], before[r, REJECT - 1])   # a step that is not rejected moves them
        assert _same(after[r, REJECT], after[r, REJECT - 1]), r      # no parameter, no Adam moment, no count
        moved = [k for k in after[r, REJECT] if not torch.equal(after[r, REJECT + 1][k], after[r, REJECT][k])]
        assert moved and all(torch.isfinite(after[r, REJECT + 1][k]).all() for k in moved)   # it trains on
