"""The executor's end of step for gradients: sums over replicas and tied stages, the fp16 overflow vote,
clipping to a global norm, the optimizer step and the step's losses.

A parameter to whose gradient no microbatch contributed this step (all of its
stage's, or of its tied group's, were dropped) gets no optimizer step: its
gradient is zero, and Adam's momentum would still move it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from planner.errors import ProtocolError
from planner.runtime.rank import audit_sync, replica_checks
from planner.runtime.wire import comm, control

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard: the scale is NORM / (total norm + CLIP_EPS)


class GradientSteps:
    """Gradient all-reduces, the optimizer step and the losses.

    Mixed into :class:`~planner.runtime.rank.executor.Executor`, whose per-step state (``_reset``) it reads
    and writes.
    """

    def _allreduce(self) -> None:
        self._settle_all()
        self._average_passes()
        if self.groups.stage is None or not self.replica_params:
            return
        with self._timed("comm"):
            self.stage_trained = self._sum_grads(self.replica_params, group=self.groups.stage,
                                                 ranks=self.groups.stage_ranks,
                                                 doing=f"all-reducing stage {self.info.stage}'s gradients")

    def _sum_grads(self, params: Sequence[torch.nn.Parameter], *, group, ranks: Sequence[int], doing: str) -> int:
        """Sum ``params``' gradients over ``group``; with verification, also how many microbatches trained
        on its ranks (one more element in the same message)."""
        flat = comm.flat_grads(params)
        if self.verifying:
            flat = torch.cat([flat, flat.new_tensor([float(self._trained_here())])])
        replica_checks.reduce_replicas(self, flat, group=group, ranks=ranks, doing=doing)
        trained = self._trained_here()
        if self.verifying:
            trained, flat = round(float(flat[-1])), flat[:-1]
        comm.unflatten_grads(flat, params)
        return trained

    def _sync_tied(self) -> list[torch.nn.Parameter]:
        """Sum the tied parameters' gradients across their stages; returns those no microbatch trained."""
        named = dict(self.stage.parameters()) if self.stage is not None else {}
        idle = []
        for group, ranks, names in self.groups.tied:
            params = [named[n] for n in names]
            if not self._sum_grads(params, group=group, ranks=ranks, doing="summing tied parameters' gradients"):
                idle.extend(params)
        return idle

    def _idle_params(self, tied_idle: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The parameters no microbatch of this step trained (verified runs: every one dropped)."""
        if not self.verifying or self.stage is None:
            return []
        trained = self.stage_trained if self.stage_trained is not None else self._trained_here()
        return (list(self.replica_params) if trained == 0 else []) + tied_idle

    def _average_passes(self) -> None:
        """Gradient accumulation: the step's passes summed their mean gradients; their mean is the gradient
        of the mean loss over all their microbatches (once, before the first sum over ranks)."""
        if self.accumulate > 1 and not self.averaged:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.accumulate)
        self.averaged = True

    @property
    def step_lr(self) -> float:
        """The learning rate of this rank's optimizer (its first group's; 0 without one)."""
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0

    def _optim(self) -> None:
        self._settle_all()
        self._average_passes()
        with self._timed("comm"):
            tied_idle = self._sync_tied()
        idle = self._idle_params(tied_idle)
        with self._timed("optim"):
            if self.scaler is not None and self._overflowed():
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                return
            if self.clip_grad is not None:
                self._clip()
            if self.keep_grads and self.stage is not None:  # the gradients the optimizer steps with
                self.last_grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                                   for n, p in self.stage.parameters()}
            audit_sync.keep_applied(self, idle)   # what an auditor's copy of this stage steps with
            for p in idle:
                p.grad = None  # no step for it: the optimizer skips a parameter without a gradient
            if self.optimizer is not None:
                if len(idle) < len(self.params):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    def _end_step_without_stage(self) -> None:
        """A verifier-only rank joins the step's decisions the stage ranks took in OPTIM: the overflow vote,
        then (where the step goes ahead) the global norm, with no gradients of its own."""
        if self.scaler is not None and self._overflowed():
            return
        if self.clip_grad is not None:
            self._clip()

    def _norm_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this rank counts in the global norm: each once in the whole run,
        on the lowest rank holding it (replicas and tied stages hold the same summed gradient)."""
        if self.stage is None:
            return []
        holders = {n: ranks for _, ranks, names in self.groups.tied for n in names}
        stage_ranks = self.groups.stage_ranks or (self.rank,)
        return [p for n, p in self.stage.parameters() if min(holders.get(n, stage_ranks)) == self.rank]

    def _clip(self) -> None:
        """Scale this rank's gradients by min(1, NORM / (global norm + eps)), as clip_grad_norm_ would over
        the whole model. The global norm is one control exchange: every rank sends its squared norm to the
        control rank, which checks and sums them and sends the total back (no collective an untrusted
        rank could add to)."""
        grads = [p.grad for p in self._norm_params() if p.grad is not None]
        mine = sum((g.detach().double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))
        total = float(mine)
        if self.plan.num_ranks > 1:
            total = self._global_square_norm(mine.reshape(1).to(self.device))
        norm = math.sqrt(total)
        if math.isfinite(norm) and norm + CLIP_EPS > self.clip_grad:  # else the scale is 1 (diverged: nan / inf)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.clip_grad / (norm + CLIP_EPS))

    def _global_square_norm(self, mine: torch.Tensor) -> float:
        ctl, everyone = control.CONTROL_RANK, range(self.plan.num_ranks)
        got = control.gather_to(mine, dst=ctl, me=self.rank, ranks=everyone, topic=control.Topic.CLIP,
                                device=self.device, doing="sending the squared norm of this rank's gradients")
        total = None
        if got is not None:
            for sender, t in got.items():
                value = float(t.reshape(-1)[0])
                if sender == ctl:
                    continue  # its own sum, not a message
                if value < 0:  # nan or inf: diverged training, which no host is to blame for (no clip then)
                    raise ProtocolError(f"rank {sender} sent an impossible squared gradient norm", sender=sender,
                                        expected="a number >= 0", found=str(value),
                                        fix=f"check rank {sender}'s host: it does not run this runtime")
            total = torch.stack([t.reshape(()) for t in got.values()]).sum().reshape(1)
        return float(control.send_from(total, src=ctl, me=self.rank, ranks=everyone, topic=control.Topic.CLIP,
                                       shape=(1,), dtype=torch.float64, device=self.device,
                                       doing="hearing the gradients' global norm")[0])

    def _overflowed(self) -> bool:
        """Unscale this rank's gradients and vote whether any overflowed (fp16): the control rank hears
        every vote and sends one decision to all, so every rank moves the scale alike and no rank's vote
        can cancel another's. A rank whose own gradients overflowed skips its update whatever it hears."""
        assert self.scaler is not None
        mine = bool(self.scaler.unscale(self.params))
        decided = mine
        if self.plan.num_ranks > 1:
            ctl, everyone = control.CONTROL_RANK, range(self.plan.num_ranks)
            vote = torch.tensor([int(mine)], dtype=torch.int64, device=self.device)
            got = control.gather_to(vote, dst=ctl, me=self.rank, ranks=everyone, topic=control.Topic.OVERFLOW,
                                    device=self.device, doing="voting whether any gradient overflowed")
            decision = None
            if got is not None:
                votes = control.checked_ints(got, what="overflow vote", expected="0 or 1",
                                             allowed=lambda _, v: v in (0, 1))
                decision = torch.tensor([int(any(votes.values()))], dtype=torch.int64, device=self.device)
            decided = bool(control.send_from(decision, src=ctl, me=self.rank, ranks=everyone,
                                             topic=control.Topic.OVERFLOW, shape=(1,), dtype=torch.int64,
                                             device=self.device, doing="hearing whether any gradient overflowed")
                           .item())
        self.scaler.update(decided)
        return decided or mine

    def _keep_pass_losses(self) -> None:
        """At the end of a pass: keep its kept microbatches' losses (a last-stage rank's)."""
        if self.stage is not None and self.stage.is_last:
            self.kept_losses += [float(loss.detach()) for mb, loss in self.losses.items() if mb not in self.dropped_f]

    def _losses(self) -> tuple[float, int]:
        """(sum, count) of the step's kept microbatch losses, all passes, on a last-stage rank; (0, 0)
        elsewhere.

        ``step_losses`` keeps this rank's share of the step objective (sum / (M x passes), dropped ones
        as 0), which is what the gradients of the step are gradients of.
        """
        if self.stage is None or not self.stage.is_last:
            return 0.0, 0
        kept = self.kept_losses
        self.step_losses.append(sum(kept) / (self.num_mb * self.accumulate))
        return sum(kept), len(kept)
