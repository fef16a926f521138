"""The executor's compute: a microbatch's forward and backward pass on this rank's stage, and the step's
timers (wall and thread CPU time of compute, waits, transfers, verification and the optimizer)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from planner.errors import InvalidInputError
from planner.runtime.rank.deferred import HeldBackward, ReplayPoint


@dataclass(slots=True)
class StepTimers:
    """Seconds spent this step, by kind (see StepMetrics for what each covers)."""

    compute: float = 0.0
    compute_cpu: float = 0.0
    pad: float = 0.0
    wait: float = 0.0
    comm: float = 0.0
    verify: float = 0.0
    optim: float = 0.0
    # This thread's CPU time in the same intervals: beside the wall times it tells the executor's own
    # work from time spent descheduled (ranks that share cores).
    wait_cpu: float = 0.0
    comm_cpu: float = 0.0
    verify_cpu: float = 0.0
    optim_cpu: float = 0.0


class ComputeSteps:
    """Forward and backward passes, and booking their time.

    Mixed into :class:`~planner.runtime.rank.executor.Executor`, whose per-step state (``_reset``) it reads
    and writes.
    """

    def _stage_inputs(self, mb: int) -> list[torch.Tensor]:
        assert self.stage is not None
        if self.stage.is_first:
            assert self.batches is not None
            return list(self.batches.microbatch(self.step, mb)[0])
        tensors = self._take(("F", mb))
        if mb in self.dropped_f:
            tensors = [torch.zeros_like(t) for t in tensors]
        return tensors

    def _forward(self, mb: int) -> None:
        raw = self._stage_inputs(mb)
        self.received.pop(("F", mb), None)  # from here on `inputs` (saved until B) hold the data
        if ("F", mb) in self.verdicts and mb not in self.dropped_f:
            self.replays[mb] = ReplayPoint.take(self.device, self.buffers)
        self._run_forward(mb, raw)

    def _run_forward(self, mb: int, raw: list[torch.Tensor]) -> None:
        stage = self.stage
        assert stage is not None
        inputs = [t.detach().requires_grad_(spec.carries_grad and t.is_floating_point())
                  for t, spec in zip(raw, stage.inputs)]
        t0, c0 = time.perf_counter(), time.thread_time()
        # Received in the compute dtype, fed in the traced one (the graph may assert it), differentiably.
        args = [t.to(spec.dtype) if t.is_floating_point() else t for t, spec in zip(inputs, stage.inputs)]
        with torch.enable_grad(), self.precision.autocast(self.device):
            outputs = tuple(stage.module(*args))
            if not stage.is_last:
                outputs = self.precision.to_wire(outputs)
            else:
                assert self.batches is not None and self.loss_fn is not None
                targets = self.batches.microbatch(self.step, mb)[1]
                loss = self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, targets)
                if mb in self.dropped_f:
                    loss = loss * 0.0
                self.losses[mb] = loss
        self._computed("F", t0, c0)
        self.saved[mb] = (inputs, outputs)

    def _backward(self, mb: int) -> None:
        stage = self.stage
        assert stage is not None
        if mb not in self.saved:
            raise InvalidInputError(f"rank {self.rank}: backward of microbatch {mb} before its forward",
                                    fix="regenerate the plan (its program is out of order)")
        self._settle_forward(mb)   # the last stage's loss, or a forward that must run again
        self._settle_backward()    # the gradients of an earlier backward still held
        inputs, outputs = self.saved.pop(mb)
        hold = False
        if stage.is_last:
            scale = self.scaler.scale if self.scaler is not None else 1.0
            roots, grads = [self.losses[mb] * (scale / self.num_mb)], [None]
        else:
            received = self._take(("B", mb))
            self.received.pop(("B", mb), None)
            if mb in self.dropped_b:
                received = [torch.zeros_like(g) for g in received]
            hold = ("B", mb) in self.verdicts and mb not in self.dropped_b
            carrying = [o for o, spec in zip(outputs, stage.outputs) if spec.carries_grad]
            pairs = [(o, g) for o, g in zip(carrying, received) if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if hold:  # keep this backward's parameter gradients apart until its verdict comes
            stash = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
            self.held = HeldBackward(mb=mb, stash=stash)
        t0, c0 = time.perf_counter(), time.thread_time()
        if roots:
            torch.autograd.backward(roots, grads)
        self._computed("B", t0, c0)
        if not stage.is_first:
            self.input_grads[mb] = [
                (t.grad if t.grad is not None else torch.zeros_like(t))
                for t, spec in zip(inputs, stage.inputs) if spec.carries_grad]

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Add the wall and thread CPU time of the block to timer ``what`` (comm, wait, verify, optim)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            setattr(self.t, what, getattr(self.t, what) + time.perf_counter() - t0)
            setattr(self.t, f"{what}_cpu", getattr(self.t, f"{what}_cpu") + time.thread_time() - cpu0)

    def _computed(self, op: str, t0: float, cpu0: float) -> None:
        """Book a pass that started at wall ``t0`` and thread CPU time ``cpu0``, and pad it if emulating."""
        elapsed = time.perf_counter() - t0
        cpu = time.thread_time() - cpu0 if self._pass_on_this_thread else None
        self.t.compute += elapsed
        self.t.compute_cpu += cpu or 0.0
        if self.emulation.active:
            self.t.pad += self.emulation.pad(op, elapsed, cpu)
