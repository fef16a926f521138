"""The options of a run: one value for every rank (:class:`RunOptions`), checked where it is made.

``RunOptions.worker_argv`` writes them as the flags every worker parses back (``planner.runtime.run_args``);
the model and data specs a run may import are checked here too.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from models.registry import is_data_spec
from planner.errors import InvalidInputError
from planner.model_io import is_onnx_spec
from planner.rehearsal import REHEARSE_DTYPES

EVENT_PREFIX = "@stagewise "
FAULT_KINDS = ("die", "hang", "raise")
INIT_KINDS = ("pretrained", "random")
LR_SCHEDULES = ("constant", "linear", "cosine")  # after the warm-up: hold --lr, or decay it to 0 at --steps
AUDIT_EVERY = 4   # integrity.audit.DEFAULT_EVERY (the options sit below the integrity layer; a test keeps them equal)


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """An injected failure for rehearsals: ``rank`` dies, hangs or raises at the start of ``step``."""

    rank: int
    kind: str
    step: int = 1

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS or self.rank < 0 or self.step < 0:
            raise InvalidInputError("--fault", expected=f"RANK:{'|'.join(FAULT_KINDS)}[:STEP]",
                                    found=f"{self.rank}:{self.kind}:{self.step}")

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError(text)
            return cls(rank=int(parts[0]), kind=parts[1], step=int(parts[2]) if len(parts) == 3 else 1)
        except ValueError:
            raise InvalidInputError(f"--fault {text!r}", expected=f"RANK:{'|'.join(FAULT_KINDS)}[:STEP], e.g. 2:hang:1")

    def __str__(self) -> str:
        return f"{self.rank}:{self.kind}:{self.step}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """Everything a run needs; the same for every rank (the local launcher passes it on the command line)."""

    plan: str
    steps: int = 5
    timeout_s: float = 60.0
    emulate: bool = False
    emulate_slowdown: float = 1.0   # the fastest planned device runs this many times slower than here
    metrics: str | None = None
    report: str | None = None
    attacks: tuple[str, ...] = ()
    verify: bool = True
    wait_verdicts: bool = False
    seed: int = 0
    data: str = "auto"
    loss: str | None = None
    lr: float | None = None
    lr_warmup: int = 0
    lr_schedule: str = "constant"
    weight_decay: float = 0.0
    clip_grad: float | None = None  # clip the gradients' global norm (all stages) to this
    dump: str | None = None
    fault: FaultSpec | None = None
    threads: int = 1
    rehearse_dtype: str = "auto"    # the compute dtype here (planner.rehearsal): auto runs fp16 plans as bf16 on a CPU
    backend: str = "auto"
    model: str | None = None        # the model factory the user allows (a plan's spec is never imported alone)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10      # steps between checkpoints (and one after the last step)
    resume: bool = False            # continue from the newest complete checkpoint in checkpoint_dir
    secret_file: str | None = None  # the run secret (default: STAGEWISE_SECRET, else this user's local one)
    host: str | None = None         # under torchrun: this host's name in the plan (planner.runtime.launcher.hosts)
    elastic: bool = False           # under torchrun's elastic restarts: re-plan for the hosts present
    replan_time_limit_s: float = 30.0  # the solver's limit when an elastic start re-plans
    cluster: str | None = None      # the operator's cluster the plan's trust is checked against (planner.plan_load)
    store: tuple[str, int] | None = None  # the run's own store (address, port) instead of torchrun's
    init: str = "pretrained"        # an hf:DIR model starts from the folder's weights; "random": from its seed
    eval_data: str | None = None    # a --data spec of the validation set (forward only, no optimizer step)
    eval_every: int | None = None   # steps between validation passes (None: after the last step only)
    tensorboard: str | None = None  # rank 0 logs scalars into this folder (torch.utils.tensorboard)
    accumulate: int = 1             # pipeline passes (each the plan's microbatches) per optimizer step
    robust_reduce: bool = False     # untrusted replicas' gradients summed by centered clipping (replica_checks)
    # audit one in this many of every watched replica's microbatches (0: off; rank.audits); None: as the plan
    # chose per stage (``StageInfo.audit_every``, priced; 0 there: not audited)
    audit_every: int | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InvalidInputError("--steps", expected=">= 1", found=str(self.steps))
        if not _finite_above_zero(self.timeout_s):
            raise InvalidInputError("--timeout", expected="a finite number of seconds > 0", found=str(self.timeout_s))
        if self.rehearse_dtype not in REHEARSE_DTYPES:
            raise InvalidInputError("--rehearse-dtype", expected=" or ".join(REHEARSE_DTYPES),
                                    found=repr(self.rehearse_dtype))
        if self.threads < 1:
            raise InvalidInputError("--threads", expected=">= 1", found=str(self.threads))
        if self.backend not in ("auto", "gloo", "nccl"):
            raise InvalidInputError("--backend", expected="auto, gloo or nccl", found=repr(self.backend))
        if self.lr is not None and not _finite_above_zero(self.lr):
            raise InvalidInputError("--lr", expected="a finite number > 0", found=str(self.lr))
        if not (math.isfinite(self.emulate_slowdown) and self.emulate_slowdown >= 1.0):
            raise InvalidInputError("--emulate-slowdown", expected="a factor >= 1 (1: the fastest planned device "
                                    "runs at this machine's speed)", found=str(self.emulate_slowdown))
        if self.emulate_slowdown > 1.0 and not self.emulate:
            raise InvalidInputError("--emulate-slowdown", expected="--emulate-speed as well",
                                    found="a slowdown without emulated speeds", fix="add --emulate-speed")
        if self.audit_every is not None and self.audit_every < 0:
            raise InvalidInputError("--audit-every", expected="a number of microbatches >= 1, or 0 (no audits)",
                                    found=str(self.audit_every))
        if self.checkpoint_every < 1:
            raise InvalidInputError("--checkpoint-every", expected="a number of steps >= 1",
                                    found=str(self.checkpoint_every))
        if self.resume and self.checkpoint_dir is None:
            raise InvalidInputError("--resume", expected="--checkpoint-dir DIR as well",
                                    found="no checkpoint folder", fix="add --checkpoint-dir with the earlier run's folder")
        if self.elastic and self.checkpoint_dir is None:
            raise InvalidInputError("--elastic", expected="--checkpoint-dir DIR as well (on storage every host "
                                    "reaches)", found="no checkpoint folder", fix="add --checkpoint-dir SHARED/DIR")
        if not _finite_above_zero(self.replan_time_limit_s):
            raise InvalidInputError("--replan-time-limit", expected="a finite number of seconds > 0",
                                    found=str(self.replan_time_limit_s))
        if self.init not in INIT_KINDS:
            raise InvalidInputError("--init", expected=" or ".join(INIT_KINDS), found=repr(self.init))
        if self.lr_warmup < 0:
            raise InvalidInputError("--lr-warmup", expected="a number of steps >= 0 (0: none)",
                                    found=str(self.lr_warmup))
        if self.lr_schedule not in LR_SCHEDULES:
            raise InvalidInputError("--lr-schedule", expected=", ".join(LR_SCHEDULES), found=repr(self.lr_schedule))
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise InvalidInputError("--weight-decay", expected="a finite number >= 0 (0: none)",
                                    found=str(self.weight_decay))
        if self.clip_grad is not None and not _finite_above_zero(self.clip_grad):
            raise InvalidInputError("--clip-grad", expected="a finite gradient norm > 0",
                                    found=str(self.clip_grad), fix="drop --clip-grad to train unclipped")
        if self.eval_every is not None and self.eval_every < 1:
            raise InvalidInputError("--eval-every", expected="a number of steps >= 1", found=str(self.eval_every))
        if self.eval_every is not None and self.eval_data is None:
            raise InvalidInputError("--eval-every", expected="--eval-data SPEC as well", found="no validation data",
                                    fix="add --eval-data (a --data spec, e.g. tokens:VAL.npy)")
        if self.accumulate < 1:
            raise InvalidInputError("--accumulate", expected="a number of pipeline passes per optimizer step >= 1",
                                    found=str(self.accumulate))

    def evaluates_after(self, step: int) -> bool:
        """Whether a validation pass follows ``step`` (from 0): every ``eval_every`` steps and after the last."""
        if self.eval_data is None:
            return False
        every = self.eval_every is not None and (step + 1) % self.eval_every == 0
        return every or step == self.steps - 1

    def worker_argv(self) -> list[str]:
        """The command-line form of these options (parsed back by :func:`parse_worker_args`)."""
        argv = [os.fspath(self.plan), "--steps", str(self.steps), "--timeout", str(self.timeout_s),
                "--seed", str(self.seed), "--data", self.data, "--threads", str(self.threads),
                "--backend", self.backend]
        for flag, value in (("--metrics", self.metrics), ("--report", self.report), ("--loss", self.loss),
                            ("--lr", self.lr), ("--lr-warmup", self.lr_warmup or None), ("--dump", self.dump),
                            ("--weight-decay", repr(self.weight_decay) if self.weight_decay else None),
                            ("--clip-grad", None if self.clip_grad is None else repr(self.clip_grad)),
                            ("--fault", self.fault), ("--model", self.model),
                            ("--checkpoint-dir", self.checkpoint_dir), ("--secret-file", self.secret_file),
                            ("--host", self.host), ("--cluster", self.cluster),
                            ("--eval-data", self.eval_data), ("--eval-every", self.eval_every),
                            ("--tensorboard", self.tensorboard),
                            ("--audit-every", self.audit_every)):
            if value is not None:
                argv += [flag, str(value)]
        for spec in self.attacks:
            argv += ["--attack", spec]
        if self.emulate:
            argv.append("--emulate-speed")
        if self.emulate_slowdown != 1.0:
            argv += ["--emulate-slowdown", repr(self.emulate_slowdown)]
        if not self.verify:
            argv.append("--no-verify")
        if self.wait_verdicts:
            argv.append("--wait-verdicts")
        if self.checkpoint_every != 10:
            argv += ["--checkpoint-every", str(self.checkpoint_every)]
        if self.resume:
            argv.append("--resume")
        if self.init != "pretrained":
            argv += ["--init", self.init]
        if self.rehearse_dtype != "auto":
            argv += ["--rehearse-dtype", self.rehearse_dtype]
        if self.lr_schedule != "constant":
            argv += ["--lr-schedule", self.lr_schedule]
        if self.accumulate != 1:
            argv += ["--accumulate", str(self.accumulate)]
        if self.robust_reduce:
            argv.append("--robust-reduce")
        return argv


def check_accumulate(opts: RunOptions, *, verifying: bool) -> None:
    """Accumulation with verification on is refused: verifiers score and ban per pipeline pass, while the
    optimizer would step once per ``accumulate`` passes (their bookkeeping is not built for that)."""
    if opts.accumulate > 1 and verifying:
        raise InvalidInputError(f"--accumulate {opts.accumulate} with verification on",
                                expected="--accumulate 1 on a verified plan", found="a plan with verifiers",
                                fix="add --no-verify (trusted devices only) or drop --accumulate")


def _finite_above_zero(value: float) -> bool:
    return math.isfinite(value) and value > 0


def is_factory_spec(spec: str) -> bool:
    """Anything but a known preset, an ``hf:`` config or an ONNX file (``models.registry.is_data_spec``): an
    allowlist, so no prefix or spelling a plan invents counts as data."""
    return not is_data_spec(spec)


def refuse_onnx_model(spec: str) -> None:
    """A plan made from an ONNX file cannot run here: the runtime splits and trains a torch model."""
    if is_onnx_spec(spec):
        raise InvalidInputError(f"the plan's model {spec!r} is an ONNX file",
                                expected="a plan made from a preset or package.module:factory (the torch runtime "
                                         "trains torch models)",
                                fix=f"plan and run the model spec {spec} was exported from, or write the stage "
                                    f"files with `stagewise export-onnx --plan PLAN -o DIR`")


def _shown(spec: str) -> str:
    """A spec as typed on a command line, quoted where it holds spaces or control characters (one line)."""
    return spec if spec.isprintable() and not any(c.isspace() for c in spec) else repr(spec)


def check_model_allowed(plan_spec: str, named: str | None) -> None:
    """Refuse a plan whose model is a factory the user did not name: the plan file is data, and
    ``stagewise run`` imports code only on the user's word, before anything of the plan runs."""
    refuse_onnx_model(plan_spec)  # every path to a rank's model passes here (torchrun's too)
    if not is_factory_spec(plan_spec):
        return
    if named != plan_spec:
        what = f"is the factory {plan_spec!r}" if ":" in plan_spec else \
            f"{plan_spec!r} is not a preset, an hf: config or an ONNX file"
        shown = _shown(plan_spec)
        raise InvalidInputError(f"the plan's model {what}",
                                expected=f"--model {shown} on the command line to allow importing it",
                                found="no --model" if named is None else f"--model {_shown(named)}",
                                fix=f"if you trust that code, run again with --model {shown}")
