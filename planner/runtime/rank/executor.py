"""Interpret one rank's program: compute, point-to-point transfers, verification, all-reduce, optimizer.

The program is the plan's list of instructions for this rank (see
``planner.instructions`` for their meaning); one pass over it is one
optimizer step. Sends are non-blocking (their buffers are released as they
complete, and at the latest at the end of the step); the receives a compute
needs are posted when the compute before it starts, and waited for when the
tensor is used (forward, backward, verification), so transfers overlap compute.
Received tensors and input gradients are dropped after their last use, so a
rank holds what its schedule keeps in flight, not the whole step.

Gradient scaling: the last stage back-propagates ``loss_mb / M`` for each of
the step's ``M`` microbatches, and replicas of a stage sum their gradients, so
a step equals one step on the mean loss of the whole global batch. With gradient accumulation a step
runs the program ``accumulate`` times (each pass on its own batch, all-reduce and optimizer on the last
only) and averages the passes' gradients: one step on a batch ``accumulate`` times larger.

The parts of a step live beside this module, one purpose each, mixed into
:class:`Executor`: compute (``executor_compute``), transfers
(``executor_p2p``), verification and deferred verdicts (``executor_verify``),
gradient sums and the optimizer (``executor_optim``), validation passes (``executor_eval``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from planner.errors import InvalidInputError
from planner.instructions import Instruction
from planner.runtime.rank.deferred import HeldBackward, ReplayPoint
from planner.runtime.rank.emulate import Emulation
from planner.runtime.rank.executor_compute import ComputeSteps, StepTimers
from planner.runtime.rank.executor_eval import Evaluation
from planner.runtime.rank.executor_optim import GradientSteps
from planner.runtime.rank.executor_p2p import Transfers
from planner.runtime.rank.executor_verify import Verification
from planner.runtime.rank.metrics import StepMetrics
from planner.runtime.rank.precision import LossScaler, Precision
from planner.runtime.rank.stage import EdgeSpecs, StageRuntime
from planner.runtime.data import PassBatches
from planner.runtime.wire import bans as ban_exchange
from planner.runtime.wire.comm import Groups, Pending

if TYPE_CHECKING:
    from planner.integrity.hooks import AttackHooks, VerifyHooks
    from planner.plan import Plan
    from planner.runtime.data import PlanBatches


class Executor(ComputeSteps, Transfers, Verification, GradientSteps, Evaluation):
    """Runs this rank's program step by step. One instance per rank and run."""

    def __init__(self, *, plan: "Plan", rank: int, stage: StageRuntime | None,
                 edges: dict[int, EdgeSpecs], batches: "PlanBatches | None",
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer | None, groups: Groups, device: torch.device,
                 verify: "VerifyHooks | None" = None, attacks: "AttackHooks | None" = None,
                 emulation: Emulation = Emulation(), keep_grads: bool = False,
                 defer_verdicts: bool = True, clip_grad: float | None = None, accumulate: int = 1) -> None:
        """``defer_verdicts``: compute before a verifier's verdict arrives (see ``executor_verify``);
        ``clip_grad``: the global gradient norm to clip to (``executor_optim``); ``accumulate``: program
        passes per optimizer step (refused with verification: ``options.check_accumulate``)."""
        self.plan = plan
        self.rank = rank
        self.info = plan.ranks[rank]
        self.program: tuple[Instruction, ...] = plan.programs[rank]
        self.stage = stage
        self.edges = edges
        if accumulate > 1 and verify is not None:
            raise InvalidInputError(f"--accumulate {accumulate} with verification on", expected="--accumulate 1",
                                    fix="add --no-verify or drop --accumulate")
        self.accumulate = accumulate
        self.pass_batches = PassBatches(batches, accumulate) if batches is not None and accumulate > 1 else None
        self.batches = self.pass_batches or batches
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.groups = groups
        self.device = device
        self.verify = verify
        self.attacks = attacks
        self.emulation = emulation
        # With one torch thread on CPU this thread runs every pass (CPU autograd runs on the caller), so
        # its CPU time is what a pass costs here; otherwise (intra-op threads, an asynchronous GPU) the
        # emulation can only scale wall time.
        self._pass_on_this_thread = device.type == "cpu" and torch.get_num_threads() == 1
        self.keep_grads = keep_grads
        self.clip_grad = clip_grad
        self.defer_verdicts = defer_verdicts
        self.num_mb = plan.num_microbatches
        self.precision = Precision.of(plan.config.dtype)
        # Every rank tracks the fp16 loss scale: verifiers score gradients unscaled, whatever the scale.
        self.scaler = LossScaler() if self.precision.scaled else None
        tied_names = {n for _, _, names in groups.tied for n in names}
        named = dict(stage.parameters()) if stage is not None else {}
        # Tied parameters are summed across their stages' ranks instead (one all-reduce covers replicas too).
        self.replica_params = [p for n, p in named.items() if n not in tied_names]
        self.params = list(named.values())
        # A forward run again must start from the same state; buffers only change in place (BatchNorm).
        self.buffers = tuple(b for _, b in stage.module.named_buffers()) if stage is not None else ()
        self.last_grads: dict[str, torch.Tensor] = {}
        self.step_losses: list[float] = []
        self._check_program()
        self._next_recvs = _next_recvs(self.program)
        self._grad_last_use = self._last_uses_of_input_grads()
        self._thread_mark: float | None = None  # this thread's CPU clock when its previous step ended
        # What the end-of-step exchange told every rank (verified runs only; see planner.runtime.wire.bans).
        self.bans: dict[int, ban_exchange.BanNotice] = {}
        self.unresolved: dict[int, int] = {}   # sender -> first flagged step, while its flags stand
        self.suspects: frozenset[int] = frozenset()   # senders the last step's flags named (audited on every microbatch)
        self.untrained_steps: list[int] = []   # steps in which no microbatch trained
        self._first_stage_ranks = tuple(self.plan.stage_ranks(0))

    # ------------------------------------------------------------------ setup
    def _check_program(self) -> None:
        for ins in self.program:
            if ins.op in ("F", "B", "SEND_F", "SEND_B", "RECV_F", "RECV_B", "ALLREDUCE", "OPTIM") and (
                    self.stage is None or ins.stage != self.stage.index):
                raise InvalidInputError(f"rank {self.rank}: instruction {ins}",
                                        expected=f"stage {None if self.stage is None else self.stage.index}",
                                        found=f"stage {ins.stage}", fix="regenerate the plan")

    def _last_uses_of_input_grads(self) -> dict[int, int]:
        """Program index after which a microbatch's input gradient is no longer needed (then it is freed)."""
        last: dict[int, int] = {}
        for i, ins in enumerate(self.program):
            own_check = (ins.op == "VERIFY_B" and ins.peer is None and self.stage is not None
                         and ins.boundary == self.stage.index - 1)
            if ins.op == "SEND_B" or own_check:
                last[ins.mb] = i
        return last

    @property
    def verifying(self) -> bool:
        return self.verify is not None

    # ------------------------------------------------------------------ step
    def run_step(self, step: int, start_s: float, start_cpu_s: float) -> StepMetrics:
        """Execute the program once; ``start_s``/``start_cpu_s`` are the wall and process CPU clocks
        (``time.perf_counter``, ``time.process_time``) when the previous step ended."""
        if self._thread_mark is None:
            self._thread_mark = time.thread_time()
        self.t = StepTimers()
        self.flagged = 0
        self.sent_bytes = {"F": 0, "B": 0}  # boundary payload bytes this step (executor_p2p)
        self.kept_losses: list[float] = []  # the step's kept microbatch losses, all passes (last stage)
        for k in range(self.accumulate):
            self._reset(step, k)
            self._run_pass(last=k == self.accumulate - 1)
        if self.stage is None:
            self._end_step_without_stage()  # the overflow vote and the norm the stage ranks joined in OPTIM
        banned = self._end_verification(step)
        if self.attacks is not None:
            self.attacks.end_step()
        loss_sum, loss_count = self._losses()
        t = self.t
        thread_now = time.thread_time()
        thread_cpu, self._thread_mark = thread_now - self._thread_mark, thread_now
        return StepMetrics(step=step, rank=self.rank, step_ms=1e3 * (time.perf_counter() - start_s),
                           cpu_ms=1e3 * (time.process_time() - start_cpu_s),
                           compute_ms=1e3 * t.compute, compute_cpu_ms=1e3 * t.compute_cpu, pad_ms=1e3 * t.pad,
                           wait_ms=1e3 * t.wait,
                           comm_ms=1e3 * t.comm, verify_ms=1e3 * t.verify, optim_ms=1e3 * t.optim,
                           loss_sum=loss_sum, loss_count=loss_count, dropped=len(self.dropped_f | self.dropped_b),
                           flagged=self.flagged, banned=len(banned), thread_cpu_ms=1e3 * thread_cpu,
                           wait_cpu_ms=1e3 * t.wait_cpu, comm_cpu_ms=1e3 * t.comm_cpu,
                           verify_cpu_ms=1e3 * t.verify_cpu, optim_cpu_ms=1e3 * t.optim_cpu, lr=self.step_lr,
                           sent_act_bytes=self.sent_bytes["F"], sent_grad_bytes=self.sent_bytes["B"])

    def _run_pass(self, *, last: bool) -> None:
        """One pass over the program; all but the step's last pass keep their gradients (no all-reduce,
        no optimizer step)."""
        for i, ins in enumerate(self.program):
            if not last and ins.op in ("ALLREDUCE", "OPTIM"):
                continue
            if ins.op in ("F", "B"):
                self._prefetch(i)
            self._dispatch(ins)
            if ins.op in ("SEND_B", "VERIFY_B") and self._grad_last_use.get(ins.mb) == i:
                self.input_grads.pop(ins.mb, None)  # keep memory to the schedule's in-flight bound
        self._settle_all()
        self._finish_sends()
        self._keep_pass_losses()

    def _reset(self, step: int, pass_index: int = 0) -> None:
        """The state of one pass over the program (the step's timers and flags span its passes)."""
        self.step = step
        self.pass_index = pass_index
        self.averaged = False  # whether the passes' summed gradients were divided by their count yet
        if self.pass_batches is not None:
            self.pass_batches.pass_index = pass_index
        self.recvs: dict[tuple[str, int], Pending] = {}       # ("F"/"B", mb) -> posted receive
        self.received: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.taint_in: dict[tuple[str, int], bool] = {}       # header of what this rank received
        self.saved: dict[int, tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self.sends: list[Pending] = []
        self.dropped_f: set[int] = set()   # dropped on the way forward (zeroed, loss x 0)
        self.dropped_b: set[int] = set()   # gradient dropped on the way back
        self.verdicts: dict[tuple[str, int], Pending] = {}   # deferred verdicts, posted and not yet awaited
        self.replays: dict[int, ReplayPoint] = {}            # forwards that may have to run again
        self.held: HeldBackward | None = None
        self.stage_trained: int | None = None  # microbatches that trained on this stage's replicas (all-reduced)

    def _dispatch(self, ins: Instruction) -> None:
        op = ins.op
        if op == "F":
            self._forward(ins.mb)
        elif op == "B":
            self._backward(ins.mb)
        elif op in ("SEND_F", "SEND_B"):
            self._send(ins)
        elif op in ("RECV_F", "RECV_B"):
            self._post_recv(ins)
        elif op in ("VERIFY_F", "VERIFY_B"):
            if self.verifying:
                self._verify(ins)
        elif op in ("VERDICT_F", "VERDICT_B"):
            if self.verifying:
                self._verdict(ins)
        elif op == "ALLREDUCE":
            self._allreduce()
        elif op == "OPTIM":
            self._optim()
        else:  # Instruction validates ops; a new op must be taught here
            raise AssertionError(f"unhandled instruction {ins}")


def _next_recvs(program: Sequence[Instruction]) -> list[tuple[Instruction, ...]]:
    """For each compute instruction, the RECVs between it and the compute after it (the next one's inputs)."""
    out: list[tuple[Instruction, ...]] = [()] * len(program)
    computes = [i for i, ins in enumerate(program) if ins.op in ("F", "B")]
    for here, nxt in zip(computes, computes[1:]):
        out[here] = tuple(ins for ins in program[here + 1:nxt] if ins.op in ("RECV_F", "RECV_B"))
    return out
