"""One rank of a running plan: build its stage, join the process group, run the steps.

Started by the local launcher (``stagewise run``) or by ``torchrun`` (``python
-m planner.runtime``); both pass the usual environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). The plan's rank a process runs
comes from ``planner.runtime.launcher.hosts`` (under torchrun: the host's name and the local rank).

Order matters: the plan is loaded, the model rebuilt from ``plan.model.spec``
and its fingerprint checked against a fresh export *before* the process group
is joined, so a plan for another model fails on every rank with
``PlanMismatchError`` and no rank waits for a peer that will never come.

What a rank builds is in ``rank_setup``; its checkpoints in ``rank_checkpoint``;
rank 0's per-step output in ``progress`` and the run's result in ``run_report``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import InvalidInputError, PlannerError, RankFailureError
from planner.integrity.hooks import AttackHooks, VerifyHooks, validate_attacks
from planner.rehearsal import as_rehearsed
from planner.runtime.data import eval_batches
from planner.runtime.launcher import hosts, torchrun_elastic
from planner.runtime.launcher.membership import (
    load_signed_plan,
    operator_trust,
    prove_membership,
)
from planner.runtime.options import (
    FaultSpec,
    RunOptions,
    check_accumulate,
)
from planner.runtime.outputs.progress import MetricsCollector, Progress
from planner.runtime.outputs.run_report import (
    ProgressReport,
    build_result,
    dump_rank,
    gather_finals,
    rank_final,
    write_json,
)
from planner.runtime.outputs.tensorboard import Board
from planner.runtime.rank import audit_state, audit_verdicts
from planner.runtime.rank import audits as runtime_audits
from planner.runtime.rank.emulate import Emulation, emulation_for
from planner.runtime.rank.executor import Executor
from planner.runtime.rank.metrics import (
    MetricsWriter,
    StepMetrics,
    StepSummary,
    summarize_step,
)
from planner.runtime.rank.rank_setup import (
    RankEnv,
    RankSetup,
    make_groups,
    make_lr_schedule,
    make_optimizer,
    prepare_rank,
    rank_device,
)
from planner.runtime.recovery import checkpoint, retention, survivors
from planner.runtime.recovery.forgery import Forgery
from planner.runtime.recovery.rank_checkpoint import (
    rank_state,
    resume_copies,
    resume_step,
    save_checkpoint,
)
from planner.runtime.run_args import parse_worker_args
from planner.runtime.wire import control
from planner.runtime.wire.bans import (
    BANNED_EXIT,
    BanNotice,
    RankBannedError,
    replan_hint,
)
from planner.secret import run_secret

AUDIT_WAIT_S = 60.0  # after a peer's failure: an auditor's recomputes still out, finished before it vouches


def _inject_fault(fault: FaultSpec | None, rank: int, step: int) -> None:
    """Rehearse a failure: this rank dies, hangs or raises at the start of ``step``."""
    if fault is None or fault.rank != rank or fault.step != step:
        return
    print(f"stagewise run: rank {rank}: injected fault {fault.kind!r} at step {step}", file=sys.stderr, flush=True)
    if fault.kind == "die":
        os._exit(17)
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    raise RuntimeError(f"injected error on rank {rank} at step {step}")


def run_rank(opts: RunOptions, env: RankEnv) -> dict[str, Any] | None:
    """The whole life of one rank. Returns rank 0's result dict (None elsewhere)."""

    torch.set_num_threads(opts.threads)
    key = run_secret(opts.secret_file)
    if opts.elastic:  # torchrun's elastic start: the plan for the hosts present (it may re-plan)
        start = torchrun_elastic.agree(opts, launcher_rank=env.rank, world_size=env.world_size, key=key)
        opts = dataclasses.replace(opts, plan=start.plan, resume=start.resume)
    plan, plan_digest = load_signed_plan(opts.plan, key, operator=operator_trust(opts))  # before it runs; one read
    if opts.store is not None:  # no launcher: the plan's world, this process's place by --host and LOCAL_RANK
        env = dataclasses.replace(env, world_size=plan.num_ranks)
    if env.world_size != plan.num_ranks and not opts.elastic:
        raise InvalidInputError(f"world size for plan {opts.plan}", expected=f"{plan.num_ranks} ranks",
                                found=str(env.world_size), fix=f"start {plan.num_ranks} processes in all")
    placement = hosts.place(plan, host=opts.host, launcher_rank=env.rank, local_rank=env.local_rank,
                            elastic=opts.elastic)
    if placement is None:
        print(f"stagewise: process {env.local_rank} of host {opts.host}: the plan {opts.plan} runs no rank here; "
              "exiting", file=sys.stderr, flush=True)
        return None
    launcher_rank, launcher_world = env.rank, env.world_size  # the plan's rank and world from here on
    env = dataclasses.replace(env, rank=placement.rank, world_size=plan.num_ranks)
    validate_attacks(opts.attacks, plan.num_ranks)
    device = rank_device(opts, env)
    plan = as_rehearsed(plan, opts.rehearse_dtype, device.type)  # a float16 plan on a CPU: bfloat16
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives use the current device
    setup = prepare_rank(plan, env.rank, opts, device)
    emulation = emulation_for(plan, env.rank, slowdown=opts.emulate_slowdown) if opts.emulate else Emulation()
    verifying = opts.verify and plan.policy.enabled and bool(plan.verifiers)
    control.check_authorities(plan, verifying=verifying)
    check_accumulate(opts, verifying=verifying)
    backend = "nccl" if device.type == "cuda" else "gloo"
    hosts.join(placement, backend=backend, launcher_rank=launcher_rank, world_size=env.world_size,
               timeout_s=opts.timeout_s, launcher_world_size=launcher_world, store_at=opts.store)
    prove_membership(key, plan_digest, rank=env.rank, world_size=env.world_size)
    result = _run(plan, opts, env, setup, emulation, verifying)
    # Only a clean finish tears the group down: after a failure, tearing down waits on dead peers,
    # while exiting closes this rank's connections at once, which is what tells the others.
    dist.destroy_process_group()
    return result


def _run(plan, opts: RunOptions, env: RankEnv, setup: RankSetup, emulation: Emulation,
         verifying: bool) -> dict[str, Any] | None:
    groups = make_groups(plan, setup.split, env.rank, opts.timeout_s)
    stage = setup.stage
    optimizer = make_optimizer(plan.config.optimizer, [p for _, p in stage.parameters()] if stage else [],
                               lr=opts.lr, weight_decay=opts.weight_decay)
    verify = (VerifyHooks(plan, env.rank, seed=opts.seed, data=opts.data, lr_warmup=opts.lr_warmup)
              if verifying else None)
    attacks = AttackHooks(opts.attacks, env.rank, seed=opts.seed) if opts.attacks else None
    executor = Executor(plan=plan, rank=env.rank, stage=stage, edges=setup.edges, batches=setup.batches,
                        loss_fn=setup.loss_fn, optimizer=optimizer, groups=groups, device=setup.device,
                        verify=verify, attacks=attacks, emulation=emulation, keep_grads=opts.dump is not None,
                        defer_verdicts=not opts.wait_verdicts, clip_grad=opts.clip_grad, accumulate=opts.accumulate)
    executor.robust_reduce = opts.robust_reduce   # read by replica_checks.reduce_replicas
    executor.audits = audit_state.build(plan, env.rank, opts, setup.device, verifying=verifying)
    ends = stage is not None and (stage.is_first or stage.is_last)  # the ranks that read data
    eval_set = eval_batches(plan, kind=opts.eval_data, seed=opts.seed, device=setup.device) \
        if opts.eval_data and ends else None
    collector = MetricsCollector(env.rank, env.world_size, setup.device)
    progress = Progress(events=os.environ.get("STAGEWISE_EVENTS") == "1", steps=opts.steps)
    writer = MetricsWriter(opts.metrics if env.rank == 0 else None, append=opts.resume)
    board = Board(opts.tensorboard if env.rank == 0 else None)
    summaries: list[StepSummary] = []

    def publish(done: list[list[StepMetrics]]) -> None:
        for rows in done:
            writer.write(rows)
            summaries.append(summarize_step(rows))
            progress.step(summaries[-1])
            board.write(summaries[-1])

    rank0_report = ProgressReport(plan, opts, summaries, executor) if env.rank == 0 and opts.report else None

    first = resume_step(plan, opts, env, stage, optimizer, verify, executor)
    resume_copies(opts, env, executor, first)
    lr_schedule = make_lr_schedule(optimizer, warmup=opts.lr_warmup, schedule=opts.lr_schedule,
                                   total_steps=opts.steps, first_step=first)  # from the step the run resumes at
    last_end, last_cpu = time.perf_counter(), time.process_time()
    bans: list[BanNotice] = []
    stopped = False
    tracker = survivors.Tracker(executor, first=first)
    forge = Forgery.for_rank(env.rank)  # tests only: this rank plays a hostile worker's patched process
    forged: list = []  # its forged sends, never received
    try:
        for step in range(first, opts.steps):
            _inject_fault(opts.fault, env.rank, step)
            metrics = executor.run_step(step, last_end, last_cpu)
            if opts.evaluates_after(step):  # before the clocks restart: validation is no part of a step
                metrics = executor.validated(metrics, eval_set)
            if forge is not None:
                forged.extend(forge.verdict(plan, step, executor.device))
            tracker.completed(step)
            if lr_schedule is not None:
                lr_schedule.step()  # the next step's rate; the scheduler is a few float operations
            # Every rank learnt the step's bans in it: all stop here, and no checkpoint holds the banned step.
            bans = sorted(executor.bans.values(), key=lambda n: n.rank)
            stopped = not bans and save_checkpoint(plan, opts, env, stage, optimizer, verify, executor, step,
                                                      forge=forge) \
                and step < opts.steps - 1
            last_end, last_cpu = time.perf_counter(), time.process_time()
            publish(collector.submit(metrics))
            if rank0_report is not None:
                rank0_report(False)
            if bans or stopped:
                break
    except RankFailureError:  # a peer died or hung: leave this rank's state, so the resume redoes nothing
        if opts.checkpoint_dir is not None:
            survivors.leave(opts.checkpoint_dir, tracker, rank=env.rank, fingerprint=plan.model.fingerprint,
                            params=dict(stage.parameters()) if stage is not None else {},
                            state=rank_state(plan, verify, executor),
                            keep_before=min(executor.unresolved.values(), default=None),
                            unaudited_since=audit_verdicts.unaudited_since(executor, wait_s=AUDIT_WAIT_S))
        raise
    publish(collector.finish())
    writer.close()
    board.close()
    runtime_audits.finish(executor)
    final = rank_final(env, executor, emulation, verify, attacks)
    if forge is not None:
        final = forge.summary(final)
    gathered = gather_finals(final, env, plan, executor.device)
    if opts.dump:
        dump_rank(opts.dump, env.rank, executor)
    hosts = {n.rank: plan.ranks[n.rank].host for n in bans}
    stop = _ban_stop(plan, opts, bans, hosts) if bans else None
    if env.rank != 0:
        if stop is not None:
            raise stop
        return None
    result = build_result(plan, opts, summaries, gathered, emulation_on=opts.emulate, executor=executor)
    if stopped:  # every rank stopped after this checkpoint, as the launcher asked (a host joins)
        result["stopped_at_checkpoint"] = step
    if stop is not None:
        result.update(failed=True, error=str(stop), stopped_by_bans=[n.to_dict() for n in bans])
        clean = retention.set_aside_from(retention.run_lookback(plan, opts), bans)   # the bans' resume bound + 1
        moved = checkpoint.set_aside(opts.checkpoint_dir, from_step=clean) if opts.checkpoint_dir else []
        result["tainted_checkpoints"] = [str(m) for m in moved]
    if opts.report:
        write_json(opts.report, result)
    if os.environ.get("STAGEWISE_RESULT"):
        write_json(os.environ["STAGEWISE_RESULT"], result)
    if stop is not None:
        print(f"stagewise run: {stop}", file=sys.stderr, flush=True)
        raise stop
    progress.done({k: result[k] for k in ("predicted_step_ms", "measured_step_ms", "emulated", "final_loss",
                                          "banned", "flags", "alerts", "untrained_steps")})
    return result


def _ban_stop(plan, opts: RunOptions, bans: list[BanNotice], hosts: dict[int, str]) -> RankBannedError:
    """The error every rank stops with after a ban: which rank, where, when, and how to go on."""
    # Stop rather than drop its work and go on: a sole-replica stage's ban would train nothing, and the
    # clean checkpoint is what the operator re-plans from either way.
    hint = replan_hint(os.fspath(opts.plan), min(set(hosts.values())), opts.checkpoint_dir)
    return RankBannedError(tuple(bans), hosts=hosts, fix=hint)


def write_error(rank: int, exc: BaseException) -> None:
    """Leave this rank's error where the local launcher looks for it (STAGEWISE_ERROR_DIR)."""
    folder = os.environ.get("STAGEWISE_ERROR_DIR")
    if not folder:
        return
    record = {"rank": rank, "kind": type(exc).__name__, "error": str(exc),
              "peer": getattr(exc, "peer", None)}
    forge = Forgery.for_rank(rank)
    if isinstance(exc, RankBannedError):
        record["bans"] = [n.to_dict() for n in exc.notices]
        record["hosts"] = {str(r): h for r, h in exc.hosts.items()}
        record["fix"] = exc.fix
    if forge is not None:
        record = forge.record(record)
    write_json(os.path.join(folder, f"rank{rank}.json"), record)


def main(argv: list[str] | None = None) -> int:
    opts = parse_worker_args(argv)
    env = RankEnv.from_environ(own_store=opts.store is not None)
    try:
        run_rank(opts, env)
    except RankBannedError as exc:
        write_error(env.rank, exc)
        return BANNED_EXIT
    except PlannerError as exc:
        write_error(env.rank, exc)
        print(f"stagewise run: rank {env.rank}: error: {exc}", file=sys.stderr, flush=True)
        return 3 if isinstance(exc, RankFailureError) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
