"""``stagewise plan MODEL``: solve the stage partition, placement and verifiers, and write the plan."""
from __future__ import annotations

import argparse
import time

from cost_models.codecs import COMPRESS_CHOICES
from planner.api import plan_chain
from planner.commands._common import (
    SEQ_HELP,
    add_model_argument,
    check_positive,
    check_seconds,
    process_started_s,
    seq_text,
    token_seq,
)
from planner.errors import InvalidInputError
from planner.model_io import load_chain
from planner.outputs import check_writable
from planner.secret import run_secret
from planner.solver.api import MAX_MICROBATCHES
from planner.solver.policy import VerificationPolicy


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="solve partition, placement and verification; write plan.json",
        description="Trace MODEL, solve one CP-SAT model for the stage partition, the devices of every stage "
                    "and the verifiers of untrusted boundaries (or run a baseline), report the objective and "
                    "its proven bound, and write the executable plan.")
    add_model_argument(p)
    p.add_argument("--cluster", default=None, help="cluster YAML/JSON (default: the embedded default cluster)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="compute dtype, with fp32 master weights (default auto: bf16 where every GPU has it, "
                        "else fp16 with loss scaling; fp32 without GPUs)")
    p.add_argument("--compress", choices=COMPRESS_CHOICES, default="none",
                   help="boundary codecs: none (default), fp8, int8 or int4 on every boundary, or auto: per boundary, "
                        "int8 where it pays, fp8 or none elsewhere (activations and their gradients; checked decoded); "
                        "int8 and auto also compress a replicated stage's gradient all-reduce (int8 with error feedback; "
                        "auto: int8 or PowerSGD) where it pays")
    p.add_argument("--recompute", choices=("auto", "never", "always"), default="auto",
                   help="activation recomputation per stage (default auto: searched where memory is tight, kept "
                        "on the stages whose devices need it)")
    p.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam",
                   help="optimizer the memory model and the run use (default adam; adam and adamw: 8 more bytes "
                        "per parameter; adamw's decay: `stagewise run --weight-decay`)")
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step (default 16)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default: the solver chooses among the divisors of the batch)")
    p.add_argument("--seq", type=int, default=None, help=SEQ_HELP)
    p.add_argument("--time-limit", type=float, default=30.0,
                   help="time limit of the whole command: imports, trace, solve, baselines, compile (default 30 s); "
                        "the search counts it in work, so a loaded machine plans the same, only slower (a wall-clock "
                        "ceiling of 3x stops it, and the plan says so)")
    p.add_argument("--workers", type=int, default=2, help="CP-SAT worker threads (default 2)")
    p.add_argument("--seed", type=int, default=0,
                   help="the search's random seed (default 0): the same inputs and seed give the same plan")
    p.add_argument("--gap", type=float, default=None, metavar="FRACTION",
                   help="stop once the plan is proven within this share of optimal (default 1e-4: 0.01%%)")
    p.add_argument("--baseline", choices=("uniform", "params", "greedy", "dp", "ppdp"), default=None,
                   help="skip the solver and plan with a baseline (ppdp: the best uniform pp x dp grid)")
    p.add_argument("--stages", type=int, default=None, metavar="N", help="fix the number of pipeline stages")
    p.add_argument("--replicas", type=int, default=None, metavar="N", help="fix every stage's replica count")
    p.add_argument("--no-verify", action="store_true", help="plan without integrity verifiers")
    p.add_argument("--ban-excludes-domain", action="store_true",
                   help="a banned worker's whole trust domain is planned out when the run re-plans around it")
    p.add_argument("--link-tests-cost", type=float, default=0.05, metavar="FRACTION",
                   help="the share of step time worth paying for verifiers that keep every untrusted stage's "
                        "link and residual tests (default 0.05: 5%%; 0: only where free)")
    p.add_argument("--audit-cost", type=float, default=0.05, metavar="FRACTION",
                   help="the share of step time worth paying to audit the replicas of stages with an untrusted "
                        "replica (their verifier recomputes one in K of their microbatches; default 0.05: 5%%; "
                        "0: no audits)")
    p.add_argument("--audit-within", type=int, default=10, metavar="STEPS",
                   help="the audit share is sized so that a replica corrupting all its microbatches goes "
                        "unaudited this many steps with probability at most 0.1%% (default 10; 1: every "
                        "microbatch of a replica with one a step is audited, catching an attack on its first "
                        "step; raise --audit-cost to pay for it)")
    p.add_argument("--secret-file", metavar="FILE", help="the run secret to sign the plan with (default: "
                   "$STAGEWISE_SECRET, else ~/.config/stagewise/secret, created on first use)")
    p.set_defaults(handler=run)


def _check_args(args: argparse.Namespace) -> int | None:

    check_positive(args, "global_batch", "workers")
    for name in ("stages", "replicas"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidInputError(f"--{name}", expected="a whole number >= 1", found=str(value))
    if args.baseline is not None and (args.stages is not None or args.replicas is not None):
        raise InvalidInputError("--baseline with --stages/--replicas", expected="one of them",
                                found="both", fix="a baseline fixes its own shape: drop --stages/--replicas")
    check_seconds(args, "time_limit")
    if args.gap is not None and not 0.0 <= args.gap < 1.0:
        raise InvalidInputError("--gap", expected="a relative gap in [0, 1), e.g. 0.01 for 1%", found=str(args.gap))
    if args.microbatches is None:
        if args.baseline is not None and args.global_batch > MAX_MICROBATCHES:  # a baseline's default is 1 sample
            raise InvalidInputError(f"--baseline with --global-batch {args.global_batch} and no --microbatches",
                                    expected=f"at most {MAX_MICROBATCHES} microbatches per step",
                                    fix="pass --microbatches M (a divisor of the global batch)")
        return None
    if args.microbatches > MAX_MICROBATCHES:
        raise InvalidInputError(f"--microbatches {args.microbatches}", expected=f"at most {MAX_MICROBATCHES} "
                                "(the runtime numbers a step's microbatches in 13 bits)",
                                fix="use fewer, larger microbatches")
    if args.microbatches < 1 or args.global_batch % args.microbatches:
        raise InvalidInputError(f"--microbatches {args.microbatches}",
                                expected=f"a divisor of --global-batch {args.global_batch}",
                                fix="pick a microbatch count that divides the global batch")
    return args.global_batch // args.microbatches


def run(args: argparse.Namespace) -> int:
    from rich.console import Console


    microbatch_size = _check_args(args)
    check_writable(args.output, what="plan output")  # before the solve, not after it
    key = run_secret(args.secret_file)  # a bad secret fails before the solve too
    err = Console(stderr=True)
    out = Console()
    started = process_started_s()  # --time-limit counts the start-up and the trace too
    # Trace at the microbatch size when it is fixed, else at 1 sample (the solver rescales).
    graph, chain = load_chain(args.model, batch=microbatch_size or None, seq=args.seq)
    seq = args.seq if args.seq is not None else token_seq(graph)  # recorded: the plan rebuilds the traced shape
    policy = VerificationPolicy(enabled=not args.no_verify, ban_excludes_domain=args.ban_excludes_domain,
                                link_test_cost=args.link_tests_cost, audit_cost=args.audit_cost,
                                audit_within_steps=args.audit_within)
    start = time.perf_counter()
    with err.status("solving...") as status:
        def progress(label: str, obj: float | None, bound: float | None, elapsed: float) -> None:
            parts = [label]
            if obj is not None:
                parts.append(f"objective {obj:.3f} ms")
            if bound is not None:
                parts.append(f"bound {bound:.3f} ms")
            status.update(f"solving {'  '.join(parts)}  [{time.perf_counter() - start:.1f} s]")

        plan = plan_chain(chain, args.cluster, spec=args.model, seq=seq, schedule=args.schedule,
                          global_batch=args.global_batch, microbatch_size=microbatch_size, policy=policy,
                          time_limit_s=args.time_limit, baseline=args.baseline, workers=args.workers,
                          progress=progress, gap_tolerance=args.gap, stages=args.stages, replicas=args.replicas,
                          dtype=args.dtype, optimizer=args.optimizer, recompute=args.recompute,
                          compress=args.compress,
                          started_s=started, seed=args.seed)
    path = plan.save(args.output, secret=key)
    _report(out, plan, path)
    return 0


def _report(console, plan, path) -> None:
    from rich.table import Table

    r = plan.report
    bound = f"{r.bound_ms:.3f} ms" if r.bound_ms is not None else "n/a"
    gap = f"{100 * r.gap:.2f}%" if r.gap is not None else "n/a"
    console.print(f"[bold]{plan.model.name}[/]: {r.method} {r.status}  objective {r.objective_ms:.3f} ms  "
                  f"bound {bound}  gap {gap}  solve {r.solve_s:.1f} s")
    sim = plan.predicted.step_ms
    diff = (r.objective_ms - sim) / sim if sim > 0 else 0.0
    console.print(f"{plan.num_stages} stages, {plan.num_microbatches} microbatches of "
                  f"{plan.config.microbatch_size}{seq_text(plan.model.seq)}, {plan.config.schedule}, {plan.config.dtype}, "
                  f"{plan.config.optimizer}; simulated step {sim:.3f} ms "
                  f"(objective {100 * diff:+.1f}% of it)")
    if r.bound_ms is not None and sim > 0:
        console.print(f"no plan's programs cost less than {r.bound_ms:.3f} ms: this plan is within "
                      f"{100 * max(0.0, 1 - r.bound_ms / r.objective_ms):.1f}% of the best the cost model allows "
                      f"(its simulation within {100 * max(0.0, 1 - r.bound_ms / sim):.1f}%)")
    table = Table(title="stages")
    for col in ("stage", "blocks", "first..last", "devices", "microbatches", "recompute"):
        table.add_column(col, justify="left" if col in ("first..last", "devices") else "right")
    for st in plan.stages:
        ranks = plan.stage_ranks(st.index)
        devices = ", ".join(f"{plan.ranks[k].device} ({plan.ranks[k].device_type})" for k in ranks)
        mbs = "/".join(str(len(plan.ranks[k].microbatches)) for k in ranks)
        table.add_row(str(st.index), str(st.last_block - st.first_block + 1),
                      f"{st.blocks[0].name}..{st.blocks[-1].name}", devices, mbs, "yes" if st.recompute else "no")
    console.print(table)
    if plan.verifiers:
        console.print("verifiers: " + ", ".join(f"boundary {v.boundary} on {v.device} ({v.label()})"
                                               for v in plan.verifiers))
    for note in r.notes:
        console.print(f"  {note}")
    console.print(f"wrote {path}")
