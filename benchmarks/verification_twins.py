"""Twins: verification of a replicated untrusted stage, where the attacker's twin must never be banned.

The single-process emulation of ``benchmarks/verification.py`` (gpt-tiny, the runtime's own
``Verifier.check`` / ``flag_events`` / ``end_step`` calls) in issue 37's shape: 3 stages, the middle one
untrusted and replicated on ranks 1 and 3 (rank 1 sends the even microbatches' tensors, rank 3 the odd
ones), 2 microbatches a step (one per replica), one verifier over boundary 0's gradients and boundary 1's
activations (no link test). The attacker is rank 1; ``dir=params`` attacks corrupt its gradient
contribution to the replicas' sum instead of a boundary tensor.

Per replica the stage's parameter gradients of its own microbatches are its contribution; the
contribution monitor (``planner.integrity.contributions``) sees a sketch of each before the sum, and
``--robust`` sums them by centered clipping (``planner.integrity.robust_reduce``) instead.

A ban re-plans as ``--replan-on-failure`` does: the stage goes to the twin alone, with fresh monitors, and the
model and optimizer go back to a checkpoint chosen by the runtime's own rule (``planner.integrity.lookback``):
checkpoints every ``--checkpoint-every`` steps, pruned by ``checkpoint.prunable`` with the replicas' audit
lookback, and the resume is the newest kept at or before the ban's resume bound (first flag - 25 steps at 1 in
4 with one microbatch a replica a step; before the first flag without audits).

``--audit-every k`` (default 4; 0: off) audits the replicas (``planner.integrity.audit``): each of a replica's
microbatches, drawn with probability 1/k by a draw keyed by the verifier's secret (every one while the sender
has unresolved evidence, or after a step whose flags or alerts named it: ``audit.flagged_senders``), is recomputed on the verifier from the stage's input and compared to what the
replica sent, activations and the gradient it sent upstream alike; a failed audit bans at once.

Per run: who was banned and when, flags per check, (step, sender) precision / recall / F1 of the blame
against the attacked steps while the attacker is in the plan (up to its ban: after the re-plan the run is a
clean run of another plan, and an honest twin's blame there is the clean false-blame rate, reported as
``fp_after_ban``), audits (``audits_suspected``: those of a suspect the draw left out) and their failures, and
the validation loss.

    python benchmarks/verification_twins.py --quick              # two attacks, one seed, 30 steps
    python benchmarks/verification_twins.py --attacks mixed --seeds 0 1 2 --steps 80
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.verification import ATTACKS as BOUNDARY_ATTACKS
from benchmarks.verification import Pipeline, RunConfig, run
from planner.integrity import audit, robust_reduce
from planner.integrity import contributions as contrib
from planner.integrity.lookback import Lookback
from planner.integrity.verifier import Verifier
from planner.runtime.recovery import checkpoint

TWIN = 3                               # the replica of stage 1 sending the odd microbatches
ATTACKER = 1
REPLICATED_STAGE = 1
CHECKED = ((0, "grad"), (1, "act"))    # issue 37's placement: one verifier, no link test
# the all-reduce poisoning attacks: one replica's gradient contribution
PARAM_ATTACKS = {"params-scale3": "kind=scale,factor=3,dir=params", "params-sign": "kind=scale,factor=-1,dir=params",
                 "params-noise": "kind=noise,std=1.0,dir=params"}
# issue 37's never flagged: damped outputs, gradients x3
DAMPED_ATTACKS = {"damp0.5": "kind=scale,factor=0.5", "grad-scale3": "kind=scale,factor=3,dir=grad"}
ATTACKS = {**{k: v for k, v in BOUNDARY_ATTACKS.items() if k != "adaptive-whitebox"}, **DAMPED_ATTACKS,
           **PARAM_ATTACKS}
QUICK = {"attacks": ("mixed", "params-scale3"), "seeds": (0,), "steps": 30, "start": 12}


class TwinPipeline(Pipeline):
    """Stage 1 on two replicas (by microbatch parity), its contributions seen before their sum."""

    def __init__(self, cfg: RunConfig, *, robust: bool = False, monitor: bool = True,
                 audit_every: int = audit.DEFAULT_EVERY, checkpoint_every: int = 1) -> None:
        super().__init__(cfg)
        self.config = self.verifier.config.to_dict() if self.verifier is not None else {}
        self.replanned = False   # the attacker's ban re-planned the stage onto its twin alone
        self.recovered_from: int | None = None   # the step the re-plan resumed the model from (its start)
        self.first_flagged: int | None = None    # the attacker's, as its ban reported it
        self.ledger_from: int | None = None
        self.verifier = self._verifier() if cfg.verify else None
        self.contrib = contrib.ContributionMonitor(seed=cfg.seed) if cfg.verify and monitor else None
        self.robust = robust
        self._reference: torch.Tensor | None = None
        self._radius: float | None = None
        self.params = list(self.stages[REPLICATED_STAGE].parameters())
        self.parts: dict[int, torch.Tensor] = {}
        self.checkpoint_every = checkpoint_every
        self.checkpoints: dict[int, tuple[dict, dict]] = {}   # after step s -> model and optimizer state, as kept
        self.start_state: tuple[dict, dict] | None = None     # the state before step 0 (a run resumed from nothing)
        self.most_kept = 0
        self.checks = self.flags = 0
        self.contrib_checks, self.contrib_flags = 0, {ATTACKER: 0, TWIN: 0}   # (step, replica) pairs judged, flagged
        self.contrib_flag_steps: list[int] = []   # steps the attacker's contribution was flagged
        self.contrib_withdrawn = 0   # contribution flags an audit of the same step's contribution withdrew
        # the verifier's secret: a replica cannot compute which of its microbatches are audited
        secret = hashlib.blake2b(f"audit:{cfg.seed}".encode(), digest_size=16).digest()
        self.schedule = audit.AuditSchedule(secret, audit_every) if cfg.verify and audit_every > 0 else None
        per_replica = cfg.microbatches // 2
        self.lookback = Lookback.of({ATTACKER: (audit_every, per_replica), TWIN: (audit_every, per_replica)}) \
            if self.schedule is not None else Lookback()
        self.audit_inputs: dict[int, torch.Tensor] = {}   # mb -> the replicated stage's input this step
        self.audit_params: dict[int, torch.Tensor] = {}   # mb -> its recomputed parameter gradient this step
        self.ledger = audit.AuditLedger()
        self.audit_flags: list[dict] = []
        self.audits, self.audit_fails = 0, {ATTACKER: 0, TWIN: 0}
        self.audits_suspected = 0   # audits of microbatches the draw left out, of a suspect (all but the draw's)
        self.predictable: set[int] = set()   # the step's audited suspects: each knew it would be audited
        self.flagged_before: set[int] = set()   # the senders the last step's flags or alerts named

    def _verifier(self) -> Verifier:
        """The plan's view: who is whose twin, and each sender's microbatches a step (after the re-plan, the
        twin sends all of the stage's)."""
        m = self.cfg.microbatches
        stage_of = {0: 0, TWIN: REPLICATED_STAGE, 2: 2, **({} if self.replanned else {ATTACKER: REPLICATED_STAGE})}
        per_rank = {0: m, 2: m, **({TWIN: m} if self.replanned else {ATTACKER: m // 2, TWIN: m // 2})}
        return Verifier(self.config, list(CHECKED), stage_of=stage_of, microbatches=per_rank)

    def rank_of(self, stage: int, mb: int) -> int:
        if stage != REPLICATED_STAGE:
            return stage
        return TWIN if self.replanned or mb % 2 else ATTACKER

    def _check(self, boundary, direction, x, *, step, mb, sender, labels):
        if self.verifier is None or (boundary, direction) not in CHECKED:
            return True
        verdict = self.verifier.check(boundary, direction, x, step=step, mb=mb, sender=self.rank_of(sender, mb),
                                      labels=labels if self.cfg.labels else None)
        self.checks += 1
        self.flags += int(verdict.flagged)
        return not verdict.tainted

    def _send(self, x, rank, direction, step, mb, stage_input):
        out = super()._send(x, self.rank_of(rank, mb), direction, step, mb, stage_input)
        why = self._audited(step, mb) if rank == REPLICATED_STAGE else None
        if why is not None:
            self._audit(out, direction, step, mb, stage_input)
            self.audits_suspected += why == "suspected"
        return out

    def _audited(self, step: int, mb: int) -> str | None:
        """Why the verifier audits this microbatch of the replicated stage: ``"drawn"``, its share of the
        sender's, or ``"suspected"``, every one of a sender with unresolved evidence, a contribution CUSUM past
        half its alarm or any flag or alert of the step before (``audit.flagged_senders``); None: not audited."""
        if self.schedule is None or self.verifier is None:
            return None
        sender = self.rank_of(REPLICATED_STAGE, mb)
        per_step = self.verifier.microbatches[sender]
        slot = mb if self.replanned else mb // 2
        suspects = set(self.verifier.unresolved()) | self.flagged_before | \
            (self.contrib.suspects(REPLICATED_STAGE) if self.contrib else set())
        if sender in suspects:   # it knows (the verdict names it): its pass clears its step, not its history
            self.predictable.add(sender)
        if self.schedule.audited(sender, step, slot, per_step):
            return "drawn"
        return "suspected" if sender in suspects else None

    def _audit(self, sent: torch.Tensor, direction: str, step: int, mb: int, stage_input: torch.Tensor) -> None:
        """The verifier's link test on one audited microbatch: the stage recomputed on the input the replica
        received (its activation from boundary 0; for the gradient, that and the gradient it was sent)."""
        stage, sender = self.stages[REPLICATED_STAGE], self.rank_of(REPLICATED_STAGE, mb)
        if direction == "act":
            self.audit_inputs[mb] = stage_input.detach()
            expected = audit.recompute_output(stage, stage_input)
            boundary = REPLICATED_STAGE
        else:
            expected, self.audit_params[mb] = audit.recompute_grads(stage, self.audit_inputs.pop(mb), stage_input)
            boundary = REPLICATED_STAGE - 1
        self.audits += 1
        self._judge_audit(step, mb, boundary, direction, sender, audit.relative_error(sent, expected), tensor=True)

    def _judge_audit(self, step: int, mb: int, boundary: int, direction: str, sender: int, error: float, *,
                     tensor: bool = False) -> None:
        """An audit's verdict: a failure among the step's flags; every one in the verifier (the runtime's
        ``Verifier.record_audit``), with the audited tensor where it is a boundary's (``tensor``): a pass
        withdraws the monitors' flags of that tensor."""
        event = audit.audit_event(step=step, mb=mb, boundary=boundary, direction=direction, sender=sender,
                                  error=error, tolerance=audit.TOLERANCE["float32"])
        self.ledger.record(sender, step, passed=event is None)
        vouch = tensor and audit.vouches(error, audit.TOLERANCE["float32"])
        where = {"mb": mb, "boundary": boundary, "direction": direction} if vouch else {}
        self.verifier.record_audit(sender, step, passed=event is None, **where)
        if event is not None:
            self.audit_flags.append(event)
            self.audit_fails[sender] += 1

    def _audit_contributions(self, parts: dict[int, torch.Tensor], step: int) -> set[int]:
        """A replica whose every microbatch of the step was audited: its contribution's sketch against the
        sketch of the recomputed parameter gradients (the runtime would compare per-microbatch sketches, the
        count sketch being linear). The replicas whose contributions passed."""
        seed = contrib.sketch_seed(self.cfg.seed, REPLICATED_STAGE)
        vouched = set()
        for rank, sent in parts.items():
            mbs = [mb for mb in self.audit_params if self.rank_of(REPLICATED_STAGE, mb) == rank]
            if not mbs or len(mbs) < self.verifier.microbatches[rank]:
                continue
            expected = sum(self.audit_params[mb] for mb in mbs)
            error = audit.sketch_error(contrib.sketch(sent, seed=seed), contrib.sketch(expected, seed=seed))
            self._judge_audit(step, min(mbs), REPLICATED_STAGE, "grad", rank, error)
            if error <= audit.TOLERANCE["float32"]:
                vouched.add(rank)
        self.audit_params = {}
        return vouched

    def microbatch(self, idx, tgt, step, mb):
        before = _flat(self.params)
        out = super().microbatch(idx, tgt, step, mb)
        rank = self.rank_of(REPLICATED_STAGE, mb)
        self.parts[rank] = self.parts.get(rank, torch.zeros_like(before)) + (_flat(self.params) - before)
        return out

    def end_step(self, step: int) -> tuple[list[int], set[int]]:
        self._checkpoint(step - 1)   # the state before this step's update: the checkpoint after the step before
        parts = {r: self._poisoned(r, g, step) for r, g in sorted(self.parts.items())}
        self.parts = {}
        vouched = self._audit_contributions(parts, step) if self.verifier is not None else set()
        # a ban stops the run and it goes on without the banned host: its contribution is neither judged nor summed
        trusted = [r for r in parts if self.verifier is None or r not in self.verifier.banned]
        watched = {r: parts[r] for r in trusted}
        events = self.contrib.check(REPLICATED_STAGE, watched, step=step) if self.contrib is not None else []
        for rank in vouched - self.predictable if self.contrib is not None else ():   # the audit outranks the
            self.contrib.vouch(REPLICATED_STAGE, rank)   # statistics (``runtime.rank.audit_contrib.record``)
        self.predictable = set()
        self.contrib_withdrawn += sum(e["sender"] in vouched for e in events)
        events = [e for e in events if e["sender"] not in vouched]
        self.contrib_checks += len(watched) if self.contrib is not None and len(watched) > 1 else 0
        for e in events:
            self.contrib_flags[e["sender"]] += 1
            if e["sender"] == ATTACKER:
                self.contrib_flag_steps.append(step)
        kept = [parts[r] for r in trusted] or list(parts.values())
        if self.robust and self.contrib is not None:   # the history's reference and radius from before this step
            total = robust_reduce.centered_clip(kept, reference=self._reference, history_radius=self._radius)
        else:
            total = sum(kept)
        if self.contrib is not None:
            self._reference, self._radius = self.contrib.center(REPLICATED_STAGE), self.contrib.radius(REPLICATED_STAGE)
        _unflatten(total, self.params)
        if self.verifier is None:
            return [], set()
        flags = self.verifier.flag_events(step)
        audits, self.audit_flags, self.audit_inputs = self.audit_flags, [], {}
        banned = self.verifier.end_step(step, [flags, events, audits])
        # as the runtime's lead verifier names them in the step's verdict (``executor_verify._suspects``): the
        # exchanged flags (those a passed audit refuted gone), the contributions' and the audits' among them
        self.flagged_before = audit.flagged_senders([*flags, *events, *audits])
        blamed = sorted(self.verifier.last_blamed)
        if ATTACKER in banned and not self.replanned:
            self.first_flagged = self.verifier.ban_records()[ATTACKER][0]
            # the rule this benchmark used before (for the record): also back to the step after its last passed audit
            self.ledger_from = min(self.first_flagged, self.ledger.suspect_since(ATTACKER, step)) \
                if self.audit_fails[ATTACKER] else self.first_flagged
            self._replan(self.first_flagged)
        return blamed, banned

    def _checkpoint(self, after: int) -> None:
        """Take the checkpoint after step ``after`` every ``checkpoint_every`` steps and prune as the control rank
        does (``checkpoint.prunable``: the run's lookback and the verifier's unresolved flags, known by now)."""
        if after < 0:
            self.start_state = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))
            return
        if (after + 1) % self.checkpoint_every:
            return
        self.checkpoints[after] = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))
        unresolved = self.verifier.unresolved() if self.verifier is not None else {}
        for old in checkpoint.prunable(list(self.checkpoints), now=after, unresolved=unresolved,
                                       lookback=self.lookback):
            del self.checkpoints[old]
        self.most_kept = max(self.most_kept, len(self.checkpoints))

    def _replan(self, first_flagged: int) -> None:
        """What ``--replan-on-failure`` does after a ban: a new plan without the banned host (its stage on the twin
        alone), fresh monitors (the runtime does not checkpoint them), the ban record kept, and the model and
        optimizer back at the newest kept checkpoint at or before the ban's resume bound (the runtime's rule,
        ``Lookback.resume_bound``), or the start (the data goes on)."""
        bound = self.lookback.resume_bound({ATTACKER: first_flagged})
        after = max((s for s in self.checkpoints if s <= bound), default=-1)
        self.recovered_from = after + 1
        model, optim = self.checkpoints[after] if after >= 0 else self.start_state
        self.model.load_state_dict(model)
        self.opt.load_state_dict(optim)
        self.opt.zero_grad(set_to_none=True)   # this step's gradients were the poisoned model's
        old, self.replanned = self.verifier, True
        self.verifier = self._verifier()
        self.verifier.restore_bans(old.bans_state())
        if self.contrib is not None:
            self.contrib = contrib.ContributionMonitor(seed=self.cfg.seed)

    def _poisoned(self, rank: int, grad: torch.Tensor, step: int) -> torch.Tensor:
        attacker = self.attacker
        if attacker is None or attacker.spec.rank != rank or not attacker.spec.targets("params"):
            return grad
        return attacker.apply(grad, direction="params", step=step, mb=0)


def _flat(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params])


def _unflatten(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def twin_run(attack: str | None, *, seed: int, steps: int, start: int, robust: bool = False,
             monitor: bool = True, verify: bool = True, audit_every: int = audit.DEFAULT_EVERY,
             checkpoint_every: int = 1) -> dict[str, Any]:
    """One run of the twins' shape; its bans, flags and blame scores."""
    built: list[TwinPipeline] = []

    def factory(cfg: RunConfig) -> TwinPipeline:
        built.append(TwinPipeline(cfg, robust=robust, monitor=monitor, audit_every=audit_every,
                                  checkpoint_every=checkpoint_every))
        return built[-1]

    spec = ATTACKS[attack] if attack else None
    # replan: a ban stops the run and it goes on without the banned host (the attacker attacks no more)
    cfg = RunConfig(steps=steps, stages=3, microbatches=2, seed=seed, attack=spec, start=start, verify=verify,
                    replan=True)
    t0 = time.perf_counter()
    result = run(cfg, pipeline=factory)
    pipe = built[0]
    attacked = set(result.attacked_steps)
    bans = {} if pipe.verifier is None else {s: list(v) for s, v in pipe.verifier.ban_records().items()}
    last = bans[ATTACKER][1] if ATTACKER in bans else steps   # the attacker is in the plan up to its ban
    blamed = {(s, who) for s, senders in result.blamed.items() for who in senders}
    scored = {(s, who) for s, who in blamed if s <= last}
    truth = {(s, ATTACKER) for s in attacked}
    tp, fp, fn = len(truth & scored), len(scored - truth), len(truth - scored)
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return {"attack": attack, "seed": seed, "steps": steps, "start": start, "robust": robust, "monitor": monitor,
            "banned": sorted(bans), "bans": {str(k): v for k, v in bans.items()},
            "attacker_ban_delay": (bans[ATTACKER][1] - start) if ATTACKER in bans else None,
            "checkpoint_every": checkpoint_every, **_recovery(pipe, attacked, bans),
            "twin_banned": TWIN in bans, "checks": pipe.checks, "flags": pipe.flags,
            "flag_pct": round(100 * pipe.flags / max(1, pipe.checks), 3),
            "contrib_checks": pipe.contrib_checks, "contrib_flags": {str(k): v for k, v in pipe.contrib_flags.items()},
            # flags on honest contributions (every one in a clean run, the twin's under attack) per pair judged
            "contrib_false_pct": round(100 * (sum(pipe.contrib_flags.values()) if attack is None else
                                              pipe.contrib_flags[TWIN]) / max(1, pipe.contrib_checks), 3),
            "contrib_first_flag": _first_flag(pipe, attacked), "contrib_withdrawn": pipe.contrib_withdrawn, "audit_every": audit_every, "audits": pipe.audits,
            "audits_suspected": pipe.audits_suspected,
            "audit_fails": {str(k): v for k, v in pipe.audit_fails.items()}, "tp": tp, "fp": fp, "fn": fn,
            "fp_after_ban": len(blamed - scored),
            "f1": round(f1, 3), "val_loss": round(result.val_loss, 4),
            "duration_s": round(time.perf_counter() - t0, 1)}


def _recovery(pipe: TwinPipeline, attacked: set[int], bans: dict[str, list[int]]) -> dict[str, Any]:
    """Where the attacker's ban resumed from (the start of that step) and, for the record, where the runtime's
    old rule (the step of the first flag) and this benchmark's old one (or the step after the last passed audit)
    would have: how many attacked steps each resumed state holds, how many steps the rollback discards, and the
    most checkpoints kept at once."""
    out: dict[str, Any] = {"recovered_from": pipe.recovered_from, "checkpoints_kept_max": pipe.most_kept}
    if pipe.recovered_from is None or not attacked:
        return out
    first, ban = min(attacked), bans[ATTACKER][1]
    for key, at in (("", pipe.recovered_from), ("_first_flag", pipe.first_flagged), ("_ledger", pipe.ledger_from)):
        out[f"recovered_from{key}"] = at
        out[f"resumed_attacked_steps{key}"] = max(0, at - first)   # attacked updates in the state resumed
        out[f"steps_redone{key}"] = ban + 1 - at
    return out


def _first_flag(pipe: TwinPipeline, attacked: set[int]) -> int | None:
    """Steps from the attack's start to the attacker's first contribution flag (None: never flagged)."""
    steps = pipe.contrib_flag_steps
    return (min(steps) - min(attacked)) if steps and attacked else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", nargs="+", choices=["none", *ATTACKS], default=None)
    parser.add_argument("--seeds", nargs="+", type=int, default=None)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--start", type=int, default=20)
    parser.add_argument("--robust", action="store_true", help="sum the replicas' gradients by centered clipping")
    parser.add_argument("--no-monitor", action="store_true", help="no contribution monitor (the old verifier)")
    parser.add_argument("--audit-every", type=int, default=audit.DEFAULT_EVERY,
                        help="audit one in this many of a replica's microbatches (0: no audit)")
    parser.add_argument("--checkpoint-every", type=int, default=1, help="take a checkpoint every this many steps")
    parser.add_argument("--quick", action="store_true", help="a smoke run (see above)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    attacks = args.attacks or (list(QUICK["attacks"]) if args.quick else ["none", *ATTACKS])
    seeds = args.seeds or (list(QUICK["seeds"]) if args.quick else [0, 1, 2])
    steps, start = (QUICK["steps"], QUICK["start"]) if args.quick else (args.steps, args.start)
    rows = []
    for attack in attacks:
        for seed in seeds:
            row = twin_run(None if attack == "none" else attack, seed=seed, steps=steps, start=start,
                           robust=args.robust, monitor=not args.no_monitor, audit_every=args.audit_every,
                           checkpoint_every=args.checkpoint_every)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
