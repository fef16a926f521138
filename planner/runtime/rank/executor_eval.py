"""The executor's validation pass: the plan's forwards alone on a fixed validation batch.

Each rank runs its program's forwards, and the activation transfers between stage ranks, in the
program's order (its microbatches on the same replicas), under ``torch.no_grad`` with the stage in eval
mode: no backward, no all-reduce, no optimizer step. Verifiers check nothing here and nothing is
dropped or banned: the pass changes no parameter, so a corrupted activation can only misreport the
validation loss, which is reported, never acted on. Attacks are rehearsed on training sends only.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from planner.instructions import Instruction
from planner.runtime.data import EVAL_STEP
from planner.runtime.rank.metrics import StepMetrics
from planner.runtime.wire import comm
from planner.runtime.wire.comm import Kind, Pending

if TYPE_CHECKING:
    from planner.runtime.data import PlanBatches

EVAL_OPS = ("F", "SEND_F", "RECV_F")


class Evaluation:
    """Forward-only passes over a validation batch.

    Mixed into :class:`~planner.runtime.rank.executor.Executor` (its plan, stage, edges, precision and
    loss function).
    """

    def _eval_program(self) -> tuple[Instruction, ...]:
        """The forwards and the activation transfers between stage ranks (not a verifier's copies)."""
        assert self.stage is not None
        kept = []
        for ins in self.program:
            if ins.op not in EVAL_OPS:
                continue
            if ins.op == "SEND_F" and ins.peer != self._consumer(ins):
                continue
            kept.append(ins)
        return tuple(kept)

    def validated(self, metrics: StepMetrics, batches: "PlanBatches | None") -> StepMetrics:
        """``metrics`` with the validation pass run after its step (``batches``: the validation set on the
        first and last stage's ranks, None elsewhere)."""
        loss_sum, count = self.evaluate(batches, EVAL_STEP)
        return dataclasses.replace(metrics, eval_loss_sum=loss_sum, eval_loss_count=count)

    def evaluate(self, batches: "PlanBatches | None", index: int) -> tuple[float, int]:
        """Run the forwards on batch ``index`` of ``batches``; (summed loss, microbatches) on a last-stage
        rank, (0, 0) elsewhere. Every stage rank must call it at the same point of the run."""
        if self.stage is None:
            return 0.0, 0
        module = self.stage.module
        training = module.training
        module.train(False)
        try:
            with torch.no_grad():
                losses = self._eval_forwards(batches, index)
        finally:
            module.train(training)
        return float(sum(losses)), len(losses)

    def _eval_forwards(self, batches: "PlanBatches | None", index: int) -> list[float]:
        stage = self.stage
        assert stage is not None and (batches is not None or not (stage.is_first or stage.is_last))
        recvs: dict[int, Pending | None] = {}
        outputs: dict[int, list[torch.Tensor]] = {}
        sends: list[Pending] = []
        losses: list[float] = []
        for ins in self._eval_program():
            mb = ins.mb
            if ins.op == "RECV_F":
                recvs[mb] = self._eval_recv(ins)
            elif ins.op == "F":
                inputs = list(batches.microbatch(index, mb)[0]) if stage.is_first else \
                    (recvs.pop(mb).wait() if recvs.get(mb) is not None else [])
                args = [t.to(spec.dtype) if t.is_floating_point() else t for t, spec in zip(inputs, stage.inputs)]
                with self.precision.autocast(self.device):
                    out = tuple(stage.module(*args))
                    if stage.is_last:
                        targets = batches.microbatch(index, mb)[1]
                        losses.append(float(self.loss_fn(out[0] if len(out) == 1 else out, targets)))
                    else:
                        outputs[mb] = list(self.precision.to_wire(out))
            elif outputs.get(mb):  # SEND_F of an edge that carries tensors
                sends.append(comm.send(outputs.pop(mb), peer=ins.peer, kind=Kind.ACT, boundary=stage.index,
                                       mb=mb, doing=f"sending {ins} (validation)"))
        for pending in sends:
            pending.wait()
        return losses

    def _eval_recv(self, ins: Instruction) -> Pending | None:
        assert self.stage is not None
        specs = self._specs("F", self.stage.index - 1)
        if not specs:
            return None
        return comm.recv(specs, peer=ins.peer, kind=Kind.ACT, boundary=self.stage.index - 1, mb=ins.mb,
                         device=self.device, doing=f"receiving {ins} (validation)")
