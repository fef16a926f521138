"""The auditor's copy of an audited stage (``planner.runtime.rank.audits``): recomputes its forward and input
gradients, and takes the replicas' optimizer step with the gradient they applied, on a thread of its own
(``step_later``; the next recompute waits for it, ``settle``). A step's deferred recomputes
(``audit_recompute.defer``) queue on that thread before the copy's step: first in, first out."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.runtime.rank.audit_background import Background, urgent
from planner.runtime.rank.precision import Precision
from planner.runtime.rank.stage import StageRuntime


@dataclass(slots=True)
class StageCopy:
    """The auditor's copy of one stage, its optimizer and learning-rate schedule (the replicas')."""

    runtime: StageRuntime
    optimizer: torch.optim.Optimizer | None
    schedule: Any = None
    params: list[torch.nn.Parameter] = field(default_factory=list)
    # a forward updated the stage's buffers (BatchNorm): the copy, seeing only the audited microbatches, drifts
    # from the replicas, so from then on it is kept current but audits nothing
    drifts: bool = False
    # the stage draws random numbers (dropout): a recompute would draw others and fail honest replicas
    random: str | None = None
    _buffers_checked: bool = False
    stepper: Executor | None = None   # runs the copy's optimizer steps off the run's thread (None: at once)
    pending: Future | None = None     # the step still running there
    inbox: torch.Tensor | None = None   # receives the applied gradient every step (fresh pages cost a fill)
    # names of the stage's parameters summed across stages instead (tied): not in a replica's contribution
    tied: frozenset[str] = frozenset()
    contributed: list[torch.nn.Parameter] = field(default_factory=list)
    background: Background | None = None   # the stepper's scheduling class (idle but while waited on)

    def __post_init__(self) -> None:
        self.params = [p for _, p in self.runtime.parameters()]
        # a replica's contribution to its stage's all-reduce, in its order (``Executor.replica_params``)
        self.contributed = [p for n, p in self.runtime.parameters() if n not in self.tied]

    @property
    def flat_size(self) -> int:
        """Values of an applied-gradient message: every parameter's, then one presence flag each."""
        return sum(p.numel() for p in self.params) + len(self.params)

    def forward(self, raw: Sequence[torch.Tensor], precision: Precision, device: torch.device, *, grad: bool,
                settle: bool = True):
        """The stage's inputs (as the replica held them) and outputs, as ``_run_forward`` computes them; ``settle``
        False: on the stepper, where the copy's steps queued before this one are done already."""
        if settle:
            self.settle()
        stage = self.runtime
        inputs = [t.detach().requires_grad_(grad and spec.carries_grad and t.is_floating_point())
                  for t, spec in zip(raw, stage.inputs)]
        args = [t.to(spec.dtype) if t.is_floating_point() else t for t, spec in zip(inputs, stage.inputs)]
        before = None if self._buffers_checked else [b.detach().clone() for b in self.runtime.module.buffers()]
        with torch.set_grad_enabled(grad), precision.autocast(device):
            outputs = precision.to_wire(tuple(stage.module(*args)))
        if before is not None:
            self._buffers_checked = True
            self.drifts = any(not torch.equal(a, b) for a, b in zip(before, self.runtime.module.buffers()))
        return inputs, outputs

    def input_grads(self, inputs, outputs, received: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of the stage's inputs given its outputs' (``_backward``'s, without touching ``.grad``)."""
        return self.grads(inputs, outputs, received, params=False)[0]

    def grads(self, inputs, outputs, received: Sequence[torch.Tensor], *,
              params: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The input gradients (``input_grads``) and, where ``params``, the flat gradient of the contributed
        parameters (zeros where none reached one, as ``comm.flat_grads``), from one backward."""
        stage = self.runtime
        carrying = [o for o, spec in zip(outputs, stage.outputs) if spec.carries_grad]
        pairs = [(o, g) for o, g in zip(carrying, received) if o.requires_grad]
        wrt = [t for t, spec in zip(inputs, stage.inputs) if spec.carries_grad and t.requires_grad]
        weights = [p for p in self.contributed if p.requires_grad] if params else []
        everything = [*wrt, *weights]
        got = dict(zip(map(id, everything), torch.autograd.grad([o for o, _ in pairs], everything,
                                                                [g for _, g in pairs], allow_unused=True))) \
            if pairs and everything else {}
        ins = [got.get(id(t)) if got.get(id(t)) is not None else torch.zeros_like(t)
               for t, spec in zip(inputs, stage.inputs) if spec.carries_grad]
        if not params:
            return ins, None
        flat = [(got.get(id(p)) if got.get(id(p)) is not None else torch.zeros_like(p)).reshape(-1)
                for p in self.contributed]
        return ins, torch.cat(flat) if flat else torch.zeros(0)

    def step_later(self, flat: torch.Tensor | None) -> None:
        """``apply`` on the stepper's thread (at once without one): the copy is not needed before its next
        recompute, which ``settle`` holds back until the step is done. ``flat`` is the copy's alone from here."""
        self.settle()
        if self.stepper is None:
            self.apply(flat)
        else:
            self.pending = self.stepper.submit(self.apply, flat)

    def step_when_heard(self, hearing: Any, stepped: bool) -> None:
        """``step_later`` with the gradient still travelling (``hearing``: its posted receive, ``comm.Pending``):
        the stepper waits for it, then steps (``stepped``) or not; the run's step end need not wait for it (a sole
        replica's report is judged without it). An error receiving it is raised where ``settle`` is next called."""
        self.settle()

        def heard_then_apply() -> None:
            flat = hearing.wait()[0]
            self.apply(flat if stepped else None)

        if self.stepper is None:
            heard_then_apply()
        else:
            self.pending = self.stepper.submit(heard_then_apply)

    def settle(self) -> None:
        """Wait for the copy's step still running on the stepper, if any (its error raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            with urgent(self.background):
                pending.result()

    def apply(self, flat: torch.Tensor | None) -> None:
        """The replicas' optimizer step (None: they took none this step), then the schedule's step. The gradients
        are views of ``flat`` (the received message, which nothing else reads): no copy."""
        if flat is not None and self.optimizer is not None:
            values, present = flat[:-len(self.params)], flat[-len(self.params):]
            offset = 0
            for p, here in zip(self.params, present.tolist()):
                n = p.numel()
                p.grad = values[offset:offset + n].view_as(p).to(p.dtype) if here else None
                offset += n
            if any(p.grad is not None for p in self.params):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.schedule is not None:
            self.schedule.step()
