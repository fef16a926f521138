"""The run options' command-line form: the flags ``stagewise run`` and every worker parse into a
:class:`~planner.runtime.options.RunOptions` (``RunOptions.worker_argv`` writes them back).

The local launcher passes the options to each worker on the command line; under torchrun each rank parses the
same flags itself, so both paths share this one parser.
"""
from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Sequence

from planner.errors import InvalidInputError
from planner.rehearsal import REHEARSE_DTYPES
from planner.runtime.options import AUDIT_EVERY, INIT_KINDS, LR_SCHEDULES, FaultSpec, RunOptions


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The run options. None of these flags is a prefix of a torchrun flag (torchrun would claim it)."""
    parser.add_argument("plan", help="plan JSON file (from `stagewise plan`)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to run (default 5)")
    parser.add_argument("--timeout", type=float, default=60.0, dest="timeout_s",
                        help="seconds a rank waits for a peer before declaring it dead or hung (default 60)")
    parser.add_argument("--emulate-speed", action="store_true", dest="emulate",
                        help="pad each rank's compute to its planned device's speed (fastest = this machine)")
    parser.add_argument("--emulate-slowdown", type=float, default=1.0, metavar="K",
                        help="with --emulate-speed: the fastest planned device runs K times slower than this "
                             "machine, so each rank's core idles while its device computes, as a GPU's host CPU "
                             "does (the runtime's own work, messages and checks, then overlaps compute)")
    parser.add_argument("--metrics", help="write per-step, per-rank metrics as JSON lines to this file")
    parser.add_argument("--report", help="write a JSON report (losses, step times, verification; with --profile "
                        "the prediction here and the times that priced it) to this file")
    parser.add_argument("--attack", action="append", default=[], dest="attacks", metavar="SPEC",
                        help="make a rank corrupt what it sends, e.g. rank=2,kind=scale,factor=-1,start=5")
    parser.add_argument("--no-verify", action="store_false", dest="verify",
                        help="switch the plan's integrity verification off")
    parser.add_argument("--wait-verdicts", action="store_true",
                        help="wait for each verifier's verdict before using the tensor (same results, slower: "
                             "by default a rank computes while the check runs and waits before results leave)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("--data", default="auto",
                        help="auto (byte text for byte-level LMs, else synthetic), text, synthetic, text:FILE "
                             "(a text file as bytes), tokens:FILE (token ids: flat .npy or nanoGPT uint16 .bin), "
                             "or package.module:factory")
    parser.add_argument("--loss", help="package.module:function(logits, targets) (default: the model's own)")
    parser.add_argument("--lr", type=float, help="learning rate (default 1e-3 Adam, 1e-2 SGD)")
    parser.add_argument("--lr-warmup", type=int, default=0, dest="lr_warmup", metavar="STEPS",
                        help="raise the learning rate linearly to --lr over the first STEPS steps (default 0: none)")
    parser.add_argument("--lr-schedule", default="constant", metavar="|".join(LR_SCHEDULES),
                        help="after the warm-up: constant (default) keeps --lr; linear and cosine decay it to 0 "
                             "at --steps (torch.optim.lr_scheduler)")
    parser.add_argument("--weight-decay", type=float, default=0.0, metavar="W",
                        help="the optimizer's weight decay (default 0; decoupled with plan --optimizer adamw, "
                             "an L2 term with adam and sgd, as torch.optim does)")
    parser.add_argument("--clip-grad", type=float, metavar="NORM", help="clip the gradients to this global norm "
                        "over all stages before each step (torch.nn.utils.clip_grad_norm_; default: no clipping)")
    parser.add_argument("--accumulate", type=int, default=1, metavar="K",
                        help="run K pipeline passes (each the plan's microbatches) per optimizer step, their "
                             "gradients averaged: one step on a K times larger batch (default 1; --steps and the "
                             "schedule count optimizer steps; not with verification)")
    parser.add_argument("--robust-reduce", action="store_true", help="sum the gradients of a stage whose replicas "
                        "include an untrusted one by centered clipping (Karimireddy et al. 2021) instead of an "
                        "all-reduce: one replica moves the update by at most the clipping radius (an all-gather)")
    parser.add_argument("--audit-every", type=int, default=None, metavar="K",
                        help="on a verified plan whose stage has replicas, one untrusted: its output verifier "
                             "recomputes one in each K of a replica's microbatches (at secret positions; all of a "
                             "suspect's) and bans a replica whose output or gradient differs (default: as the plan "
                             "chose per stage, priced; a stage it does not audit, or a plan from before audits: none; "
                             f"K overrides it on every auditable stage, {AUDIT_EVERY} the densest the planner picks; "
                             "0: no audits)")
    parser.add_argument("--eval-data", metavar="SPEC", help="validation data (a --data spec): the pipeline runs "
                        "forward only on one fixed global batch of it and reports the validation loss")
    parser.add_argument("--eval-every", type=int, metavar="N", help="with --eval-data: validate every N steps "
                        "(default: after the last step only; always after the last step)")
    parser.add_argument("--tensorboard", metavar="DIR", help="log the training and validation loss, learning "
                        "rate and step time to DIR (rank 0; needs `pip install tensorboard`)")
    parser.add_argument("--dump", metavar="DIR", help="save each rank's final parameters, last gradients "
                        "and losses to DIR/rank<R>.pt (to compare with a reference)")
    parser.add_argument("--fault", type=_fault_argument, metavar="RANK:KIND[:STEP]",
                        help="rehearse a failure: die, hang or raise on RANK at STEP (default 1)")
    parser.add_argument("--model", metavar="MODULE:FN", help="the model factory to import for a plan made from one "
                        "(it must equal the plan's model spec: a plan file alone never makes a rank import code)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="write a checkpoint of every rank (parameters and "
                        "optimizer state by parameter name, safetensors) into DIR")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                        help="steps between checkpoints (default 10; one is always taken after the last step)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in "
                        "--checkpoint-dir, to --steps in all (any stage layout of the same model)")
    parser.add_argument("--secret-file", metavar="FILE", help="the run secret every rank proves it holds and the "
                        "plan is signed with (default: $STAGEWISE_SECRET, else ~/.config/stagewise/secret)")
    parser.add_argument("--cluster", metavar="NAME|FILE", help="the operator's cluster (packaged name or file): who "
                        "is trusted comes from it, not from the plan's copy (default: the one the plan was made from)")
    parser.add_argument("--init", choices=INIT_KINDS, default="pretrained",
                        help="pretrained (default): an hf:DIR model starts from the folder's safetensors weights "
                             "(a model without saved weights from its seed); random: from the seed's weights. "
                             "A resumed run starts from its checkpoint either way")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--rehearse-dtype", default="auto", metavar="|".join(REHEARSE_DTYPES),
                        help="compute dtype of the ranks here (default auto: the plan's, but a float16 plan runs as "
                             "bfloat16 on a CPU, where float16 is ~24x slower; plan: the plan's always)")
    parser.add_argument("--backend", default="auto", help="auto (NCCL with CUDA, else gloo), gloo or nccl")


def _fault_argument(text: str) -> FaultSpec:
    """``FaultSpec.parse`` for argparse, which makes a usage error (one line, exit 2) only of these errors."""
    try:
        return FaultSpec.parse(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def options_from_args(args: argparse.Namespace) -> RunOptions:
    names = {f.name for f in fields(RunOptions)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["attacks"] = tuple(values.get("attacks") or ())
    return RunOptions(**values)


def parse_worker_args(argv: Sequence[str] | None = None) -> RunOptions:
    parser = argparse.ArgumentParser(prog="python -m planner.runtime",
                                     description="One rank of a Stagewise plan (start with torchrun or "
                                                 "`stagewise run`).", allow_abbrev=False)
    add_run_arguments(parser)
    parser.add_argument("--host", metavar="NAME", help="this host's name in the plan: its processes run the plan's "
                        "ranks on that host, in rank order by local rank (default: $STAGEWISE_HOST; a plan with "
                        "one host needs none)")
    parser.add_argument("--elastic", action="store_true", help="under torchrun --nnodes MIN:MAX --max-restarts N: "
                        "each start re-plans for the hosts present and resumes from --checkpoint-dir "
                        "(planner/runtime/launcher/torchrun_elastic.py)")
    parser.add_argument("--replan-time-limit", dest="replan_time_limit_s", type=float, default=30.0, metavar="S",
                        help="the solver's time limit when an elastic start re-plans (default 30)")
    parser.add_argument("--store", metavar="ADDR:PORT", type=_store_argument,
                        help="without torchrun: the run's own store, which the host of the plan's rank 0 serves on "
                             "ADDR:PORT (bound to that address alone) and the others reach there; start one "
                             "process per rank of the host, LOCAL_RANK=i for the i-th "
                             "(planner/runtime/launcher/hosts.py)")
    return options_from_args(parser.parse_args(argv))


def _store_argument(text: str) -> tuple[str, int]:
    addr, _, port = text.rpartition(":")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--store {text!r}: expected ADDR:PORT, e.g. 10.0.0.5:29500")
    return addr.strip("[]"), int(port)
