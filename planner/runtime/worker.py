"""One rank of a running plan: build its stage, join the process group, run the steps.

Started by the local launcher (``stagewise run``) or by ``torchrun`` (``python
-m planner.runtime``); both pass the usual environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). The plan's rank a process runs
comes from ``planner.runtime.hosts`` (under torchrun: the host's name and the local rank).

Order matters: the plan is loaded, the model rebuilt from ``plan.model.spec``
and its fingerprint checked against a fresh export *before* the process group
is joined, so a plan for another model fails on every rank with
``PlanMismatchError`` and no rank waits for a peer that will never come.

Each rank builds the model on the meta device and materialises only its own
stage's parameters (``models`` initialise weights by name, so they equal the
unpipelined model's); models without that ability are built whole on the CPU.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from models.registry import build_model
from planner.errors import InvalidInputError, PlannerError, RankFailureError
from planner.integrity.hooks import AttackHooks, VerifyHooks, validate_attacks
from planner.outputs import write_atomic
from planner.runtime import checkpoint, comm, hosts, messages, torchrun_elastic
from planner.runtime.bans import BANNED_EXIT, BanNotice, RankBannedError, replan_hint
from planner.runtime.comm import Groups, Kind
from planner.runtime.data import PlanBatches, make_source, resolve_loss
from planner.runtime.emulate import Emulation, emulation_for
from planner.runtime.executor import Executor
from planner.runtime.membership import load_signed_plan, prove_membership
from planner.runtime.metrics import (
    MetricsWriter,
    StepMetrics,
    StepSummary,
    measured_step_ms,
    summarize_step,
)
from planner.runtime.options import (
    EVENT_PREFIX,
    FaultSpec,
    RunOptions,
    check_model_allowed,
    parse_worker_args,
)
from planner.runtime.recompute import build_plan_stage
from planner.runtime.stage import (
    EdgeSpecs,
    SplitGraph,
    StageRuntime,
    check_fingerprint,
    export_model,
    has_constants,
    materialize,
    plan_node_names,
    split_graph,
    stage_edges,
    stage_state_names,
)
from planner.secret import run_secret


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "RankEnv":
        try:
            return cls(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        except (KeyError, ValueError) as exc:
            raise InvalidInputError("rank environment", expected="RANK and WORLD_SIZE set (by torchrun or "
                                    "`stagewise run`)", found=f"missing or bad {exc}",
                                    fix="start ranks with `stagewise run` or torchrun") from None


# --------------------------------------------------------------------------- setup
@dataclass(slots=True)
class RankSetup:
    """Everything a rank builds before joining the process group."""

    split: SplitGraph
    stage: StageRuntime | None
    edges: dict[int, EdgeSpecs]
    batches: PlanBatches | None
    loss_fn: Any
    device: torch.device


def _device(opts: RunOptions, env: RankEnv) -> torch.device:
    if opts.backend == "nccl" or (opts.backend == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def check_model(plan, *, seed: int = 0, model: str | None = None):
    """Rebuild the plan's model on the meta device, export it and compare fingerprints.

    Returns ``(bundle, exported program)``; raises PlanMismatchError if the
    model the spec builds today is not the one the plan was made for.
    """

    ref = plan.model
    check_model_allowed(ref.spec, model)
    bundle = build_model(ref.spec, batch=ref.batch, seq=ref.seq, device="meta", seed=seed)
    ep = export_model(bundle.module, bundle.example_inputs)
    check_fingerprint(ep, plan)
    return bundle, ep


def prepare_rank(plan, rank: int, opts: RunOptions, device: torch.device) -> RankSetup:
    """Rebuild the model, check the fingerprint, split it and build this rank's stage."""

    ref = plan.model
    bundle, ep = check_model(plan, seed=opts.seed, model=opts.model)
    mbs = plan.config.microbatch_size
    if mbs != ref.batch:  # traced at another batch: export again at the microbatch shape
        bundle = build_model(ref.spec, batch=mbs, seq=ref.seq, device="meta", seed=opts.seed)
        ep = export_model(bundle.module, bundle.example_inputs)
    split = split_graph(bundle.module, bundle.example_inputs, plan_node_names(plan), ep=ep)
    edges = {b: EdgeSpecs(act=tuple(split.specs[n] for n in stage_edges(split, b + 1)[0]))
             for b in range(plan.num_stages - 1)}
    info = plan.ranks[rank]
    if info.stage is None:
        return RankSetup(split=split, stage=None, edges=edges, batches=None, loss_fn=None, device=device)
    model = bundle.module
    # Presets initialise by parameter name, so a rank can materialise its own stage only and still hold
    # exactly the weights of `build_model(spec, device="cpu", seed=seed)`. A factory's weights come from
    # running it under the seed, so those ranks build the whole model.
    if bundle.preset is not None and callable(getattr(model, "init_weights", None)) and not has_constants(split):
        materialize(model, stage_state_names(split, info.stage), device)
        model.init_weights(opts.seed)
    else:
        model = build_model(ref.spec, batch=mbs, seq=ref.seq, device=str(device), seed=opts.seed).module
        if has_constants(split):
            split = split_graph(model, tuple(t.to(device) for t in bundle.example_inputs), plan_node_names(plan))
    stage = build_plan_stage(split, plan, info.stage, model, device=device)
    batches = loss = None
    if stage.is_first or stage.is_last:
        source = make_source(bundle, kind=opts.data, seq=ref.seq, seed=opts.seed)
        batches = PlanBatches(source, global_batch=plan.config.global_batch, microbatch_size=mbs, device=device)
        loss = resolve_loss(bundle, opts.loss) if stage.is_last else None
    return RankSetup(split=split, stage=stage, edges=edges, batches=batches, loss_fn=loss, device=device)


def make_groups(plan, split: SplitGraph, rank: int, timeout_s: float) -> Groups:
    """Create every subgroup on every rank in one order: replicated stages, verifiers, tied parameters."""
    stage_sets = [plan.stage_ranks(k) for k in range(plan.num_stages)]
    verifier_ranks = tuple(sorted({v.rank for v in plan.verifiers}))
    users: dict[str, set[int]] = {}
    for k in range(plan.num_stages):
        for name in stage_state_names(split, k):
            users.setdefault(name, set()).add(k)
    tied: dict[tuple[int, ...], list[str]] = {}
    params = {target for kind, target in split.state.values() if kind == "param"}
    for name, stages in sorted(users.items()):
        if len(stages) > 1 and name in params:  # a tied parameter: its stages sum its gradient
            ranks = tuple(sorted(r for k in stages for r in plan.stage_ranks(k)))
            tied.setdefault(ranks, []).append(name)
    tied_sets = sorted(tied)
    made = comm.new_groups([*stage_sets, verifier_ranks, *tied_sets], timeout_s=timeout_s)
    info = plan.ranks[rank]
    groups = Groups()
    if info.stage is not None:
        groups.stage, groups.stage_ranks = made[info.stage], stage_sets[info.stage]
    groups.verifiers, groups.verifier_ranks = made[len(stage_sets)], verifier_ranks
    for ranks, group in zip(tied_sets, made[len(stage_sets) + 1:]):
        if group is not None:
            groups.tied.append((group, ranks, tuple(tied[ranks])))
    return groups


DEFAULT_LR: dict[str, float] = {"sgd": 0.01, "adam": 1e-3}


def make_optimizer(name: str, params: Sequence[torch.nn.Parameter], *,
                   lr: float | None) -> torch.optim.Optimizer | None:
    """SGD or Adam over this rank's parameters (the plan's ``config.optimizer``; lr default per DEFAULT_LR)."""
    params = list(params)
    if not params:
        return None
    if name not in DEFAULT_LR:
        raise InvalidInputError("optimizer", expected="sgd or adam", found=repr(name))
    rate = DEFAULT_LR[name] if lr is None else lr
    return torch.optim.SGD(params, lr=rate) if name == "sgd" else torch.optim.Adam(params, lr=rate)


def make_lr_warmup(optimizer: torch.optim.Optimizer | None,
                   steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A linear learning-rate warm-up: step ``k`` (from 0) trains at ``lr * min(1, (k + 1) / steps)``, as
    most recipes start, since full-rate Adam steps on a fresh model can spike the loss. None: no warm-up."""
    if optimizer is None or steps <= 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / steps))


# --------------------------------------------------------------------------- progress
class Progress:
    """Rank 0's per-step output: JSON events for the local launcher, or text lines under torchrun."""

    def __init__(self, *, events: bool, steps: int) -> None:
        self.events = events
        self.steps = steps

    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        if self.events:
            print(EVENT_PREFIX + json.dumps({"event": kind, **payload}, allow_nan=False), flush=True)

    def step(self, s: StepSummary) -> None:
        loss = s.loss if math.isfinite(s.loss) else None
        self.emit("step", {"step": s.step, "loss": loss, "step_ms": s.step_ms, "dropped": s.dropped})
        if not self.events:
            text = "n/a" if loss is None else f"{loss:.4f}"
            print(f"step {s.step + 1}/{self.steps}  loss {text}  step {s.step_ms:.1f} ms", flush=True)

    def done(self, result: dict[str, Any]) -> None:
        self.emit("done", result)
        if not self.events:
            print(format_comparison(result), flush=True)
            if result.get("untrained_steps"):
                print(f"steps {result['untrained_steps']} trained nothing (every microbatch was dropped by "
                      "verification): the run is not complete", flush=True)


def format_comparison(result: dict[str, Any]) -> str:
    pred, meas = result["predicted_step_ms"], result["measured_step_ms"]
    ratio = meas / pred if pred > 0 else math.inf
    slowdown = result.get("emulate_slowdown", 1.0)
    how = ""
    if result.get("emulated"):
        how = ", compute emulated to planned speeds" + (f" / {slowdown:g}" if slowdown != 1.0 else "")
    return (f"predicted {pred:.1f} ms/step (simulator, planned devices), measured {meas:.1f} ms/step here "
            f"(x{ratio:.2f}{how})")


# --------------------------------------------------------------------------- run
class _MetricsCollector:
    """Rank 0 receives every other rank's per-step metrics by point-to-point messages (no barrier).

    Rank 0 posts the receives for step s when it ends step s and waits for them
    when it ends step s + 1 (the other ranks are done with step s by then), so
    collecting never holds the pipeline back.
    """

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.pending: list[tuple[StepMetrics, list[comm.Pending]]] = []
        self.sends: list[comm.Pending] = []

    def submit(self, m: StepMetrics) -> list[list[StepMetrics]]:
        """Hand in this rank's metrics; on rank 0, returns the steps now complete (all ranks' rows)."""
        tag_mb = m.step % comm.MAX_MICROBATCHES
        if self.rank != 0:
            self.sends.append(comm.send([m.to_tensor().to(self.device)], peer=0, kind=Kind.METRICS, boundary=0,
                                        mb=tag_mb, doing="sending metrics to rank 0"))
            return []
        done = self._drain()
        posted = [comm.recv([((StepMetrics.numel(),), torch.float64)], peer=r, kind=Kind.METRICS, boundary=0,
                            mb=tag_mb, device=self.device, doing=f"collecting step {m.step} metrics")
                  for r in range(1, self.world)]
        self.pending.append((m, posted))
        return done

    def _drain(self) -> list[list[StepMetrics]]:
        done = []
        for own, posted in self.pending:
            done.append([own] + [StepMetrics.from_tensor(p.wait()[0].cpu()) for p in posted])
        self.pending = []
        return done

    def finish(self) -> list[list[StepMetrics]]:
        for p in self.sends:
            p.wait()
        self.sends = []
        return self._drain() if self.rank == 0 else []


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
    plan, plan_digest = load_signed_plan(opts.plan, key)  # before anything of the plan runs; one read
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
    device = _device(opts, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives use the current device
    setup = prepare_rank(plan, env.rank, opts, device)
    emulation = emulation_for(plan, env.rank, slowdown=opts.emulate_slowdown) if opts.emulate else Emulation()
    verifying = opts.verify and plan.policy.enabled and bool(plan.verifiers)
    backend = "nccl" if device.type == "cuda" else "gloo"
    hosts.join(placement, backend=backend, launcher_rank=launcher_rank, world_size=env.world_size,
               timeout_s=opts.timeout_s, launcher_world_size=launcher_world)
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
                               lr=opts.lr)
    warmup = make_lr_warmup(optimizer, opts.lr_warmup)
    verify = (VerifyHooks(plan, env.rank, seed=opts.seed, data=opts.data, lr_warmup=opts.lr_warmup)
              if verifying else None)
    attacks = AttackHooks(opts.attacks, env.rank, seed=opts.seed) if opts.attacks else None
    executor = Executor(plan=plan, rank=env.rank, stage=stage, edges=setup.edges, batches=setup.batches,
                        loss_fn=setup.loss_fn, optimizer=optimizer, groups=groups, device=setup.device,
                        verify=verify, attacks=attacks, emulation=emulation, keep_grads=opts.dump is not None,
                        defer_verdicts=not opts.wait_verdicts)
    collector = _MetricsCollector(env.rank, env.world_size, setup.device)
    progress = Progress(events=os.environ.get("STAGEWISE_EVENTS") == "1", steps=opts.steps)
    writer = MetricsWriter(opts.metrics if env.rank == 0 else None, append=opts.resume)
    summaries: list[StepSummary] = []

    def publish(done: list[list[StepMetrics]]) -> None:
        for rows in done:
            writer.write(rows)
            summaries.append(summarize_step(rows))
            progress.step(summaries[-1])

    rank0_report = _ProgressReport(plan, opts, summaries, executor) if env.rank == 0 and opts.report else None

    first = _resume(plan, opts, env, stage, optimizer, verify, executor)
    for _ in range(first):
        if warmup is not None:
            warmup.step()  # the rate of the step the run resumes at
    last_end, last_cpu = time.perf_counter(), time.process_time()
    bans: list[BanNotice] = []
    stopped = False
    for step in range(first, opts.steps):
        _inject_fault(opts.fault, env.rank, step)
        metrics = executor.run_step(step, last_end, last_cpu)
        if warmup is not None:
            warmup.step()  # the next step's rate; the scheduler is a few float operations
        # Every rank learnt the step's bans in it: all stop here, and no checkpoint holds the banned step.
        bans = sorted(executor.bans.values(), key=lambda n: n.rank)
        stopped = not bans and _checkpoint(plan, opts, env, stage, optimizer, verify, executor, step) \
            and step < opts.steps - 1
        last_end, last_cpu = time.perf_counter(), time.process_time()
        publish(collector.submit(metrics))
        if rank0_report is not None:
            rank0_report(False)
        if bans or stopped:
            break
    publish(collector.finish())
    writer.close()
    final = _rank_final(env, executor, emulation, verify, attacks)
    gathered = gather_finals(final, env)
    if opts.dump:
        _dump(opts.dump, env.rank, executor)
    hosts = {n.rank: plan.ranks[n.rank].host for n in bans}
    stop = _ban_stop(plan, opts, bans, hosts) if bans else None
    if env.rank != 0:
        if stop is not None:
            raise stop
        return None
    result = _result(plan, opts, summaries, gathered, emulation_on=opts.emulate, executor=executor)
    if stopped:  # every rank stopped after this checkpoint, as the launcher asked (a host joins)
        result["stopped_at_checkpoint"] = step
    if stop is not None:
        result.update(failed=True, error=str(stop), stopped_by_bans=[n.to_dict() for n in bans])
        moved = checkpoint.set_aside(opts.checkpoint_dir, from_step=min(n.first_flagged_step for n in bans)) \
            if opts.checkpoint_dir else []
        result["tainted_checkpoints"] = [str(m) for m in moved]
    if opts.report:
        _write_json(opts.report, result)
    if os.environ.get("STAGEWISE_RESULT"):
        _write_json(os.environ["STAGEWISE_RESULT"], result)
    if stop is not None:
        print(f"stagewise run: {stop}", file=sys.stderr, flush=True)
        raise stop
    progress.done({k: result[k] for k in ("predicted_step_ms", "measured_step_ms", "emulated", "final_loss",
                                          "banned", "flags", "untrained_steps")})
    return result


def _layout(plan) -> list[list[Any]]:
    """Who each rank is (host, device, stage): ban evidence is per rank, so it only carries over a resume
    onto the same layout (a re-planned run numbers its ranks afresh)."""
    return [[r.host, r.device, r.stage] for r in plan.ranks]


def _resume(plan, opts: RunOptions, env: RankEnv, stage: StageRuntime | None,
            optimizer: torch.optim.Optimizer | None, verify: VerifyHooks | None, executor: Executor) -> int:
    """The first step to run: 0, or with ``--resume`` the one after the newest complete checkpoint
    (a verifier rank gets its ban evidence back: killing a rank to force a restart wipes no bans)."""
    if not opts.resume:
        return 0
    step = checkpoint.latest(opts.checkpoint_dir, fingerprint=plan.model.fingerprint)
    params = dict(stage.parameters()) if stage is not None else {}
    got = checkpoint.restore_rank(opts.checkpoint_dir, step=step, params=params, optimizer=optimizer,
                                  rank=env.rank)
    same_layout = got.state.get("layout", _layout(plan)) == _layout(plan)
    if verify is not None and verify.verifier is not None and "bans" in got.state and same_layout:
        verify.verifier.restore_bans(got.state["bans"])
    if executor.scaler is not None and "loss_scale" in got.state:
        executor.scaler.restore(got.state["loss_scale"])
    executor.untrained_steps = [int(s) for s in got.state.get("untrained_steps", [])]
    return step + 1


STOP_ENV = "STAGEWISE_STOP_FILE"  # set by the local launcher: the file whose presence asks the ranks to stop


def _checkpoint(plan, opts: RunOptions, env: RankEnv, stage: StageRuntime | None,
                optimizer: torch.optim.Optimizer | None, verify: VerifyHooks | None, executor: Executor,
                step: int) -> bool:
    """Every ``checkpoint_every`` steps and after the last: each rank writes its file, rank 0 the manifest
    (and, while a verifier's flag is unresolved, keeps the last checkpoint before it). True when the ranks
    agreed to stop after it: the local launcher asked for that (``STOP_ENV``'s file exists) when one rank
    reached the checkpoint; the agreement is the sum that replaces a barrier, so every rank decides alike."""
    if opts.checkpoint_dir is None or ((step + 1) % opts.checkpoint_every and step != opts.steps - 1):
        return False
    params = dict(stage.parameters()) if stage is not None else {}
    state: dict[str, Any] = {"layout": _layout(plan), "untrained_steps": list(executor.untrained_steps)}
    if verify is not None and verify.verifier is not None:
        state["bans"] = verify.verifier.bans_state()
    if executor.scaler is not None:
        state["loss_scale"] = executor.scaler.state()
    checkpoint.save_rank(opts.checkpoint_dir, step=step, rank=env.rank, fingerprint=plan.model.fingerprint,
                         params=params, optimizer=optimizer, state=state)
    asked = os.environ.get(STOP_ENV)
    votes = torch.tensor([1.0 if asked and os.path.exists(asked) else 0.0], device=executor.device)
    comm.all_reduce_sum(votes, group=None, ranks=range(env.world_size),
                        doing=f"writing the checkpoint of step {step}")  # every rank has written its file
    if env.rank == 0:
        checkpoint.complete(opts.checkpoint_dir, step=step, num_ranks=env.world_size,
                            fingerprint=plan.model.fingerprint,
                            keep_before=min(executor.unresolved.values(), default=None))
    return bool(votes.item() > 0)


def _ban_stop(plan, opts: RunOptions, bans: list[BanNotice], hosts: dict[int, str]) -> RankBannedError:
    """The error every rank stops with after a ban: which rank, where, when, and how to go on."""
    # Stop rather than drop its work and go on: a sole-replica stage's ban would train nothing, and the
    # clean checkpoint is what the operator re-plans from either way.
    hint = replan_hint(os.fspath(opts.plan), sorted(set(hosts.values()))[0], opts.checkpoint_dir)
    return RankBannedError(tuple(bans), hosts=hosts, fix=hint)


class _ProgressReport:
    """Rank 0 rewrites ``--report`` as the run goes (at most every ``PERIOD_S``), so a run that fails
    still leaves one with the steps it finished."""

    PERIOD_S = 2.0

    def __init__(self, plan, opts: RunOptions, summaries: list[StepSummary], executor: Executor) -> None:
        self.plan, self.opts, self.summaries, self.executor = plan, opts, summaries, executor
        self.last = -math.inf  # the first finished step is written at once

    def __call__(self, force: bool) -> None:
        if not self.summaries or (not force and time.monotonic() - self.last < self.PERIOD_S):
            return
        self.last = time.monotonic()
        partial = _result(self.plan, self.opts, self.summaries, [], emulation_on=self.opts.emulate,
                          executor=self.executor)
        _write_json(self.opts.report, {**partial, "in_progress": True})


# What every rank sends rank 0 at the end (``_rank_final``), checked on receipt.
RANK_FINAL_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["rank", "stage", "device_type", "fwd_factor", "bwd_factor", "verification", "bans", "attacked"],
    "properties": {
        "rank": {"type": "integer", "minimum": 0}, "stage": {"type": ["integer", "null"], "minimum": 0},
        "device_type": {"type": "string"}, "fwd_factor": {"type": "number"}, "bwd_factor": {"type": "number"},
        "verification": {"type": "object", "properties": {"flags": {"type": "integer", "minimum": 0}}},
        "bans": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                            "maxItems": 2}},
        "attacked": {"type": "array", "items": {"type": "array"}},
    },
}


def gather_finals(final: dict[str, Any], env: RankEnv) -> list[dict[str, Any]]:
    """Every rank's final record, as JSON (a rank's record says which rank it is: checked too)."""
    got = messages.all_gather_json(final, group=None, ranks=range(env.world_size), what="run summary",
                                   schema=RANK_FINAL_SCHEMA, doing="gathering the run summaries")
    for sender, record in enumerate(got):
        if record["rank"] != sender:
            raise RankFailureError(f"rank {sender} sent the run summary of rank {record['rank']}",
                                   expected=f"rank {sender}", found=str(record["rank"]),
                                   fix=f"check rank {sender}'s host: it does not run this runtime")
    return got


def _rank_final(env: RankEnv, ex: Executor, emulation: Emulation, verify, attacks) -> dict[str, Any]:
    return {"rank": env.rank, "stage": ex.info.stage, "device_type": ex.info.device_type,
            "fwd_factor": emulation.fwd_factor, "bwd_factor": emulation.bwd_factor,
            "verification": verify.summary() if verify is not None else {},
            "bans": list(verify.new_bans) if verify is not None else [],
            "attacked": [list(e) for e in attacks.log()] if attacks is not None else []}


def _result(plan, opts: RunOptions, summaries: list[StepSummary], ranks: list[dict[str, Any]], *,
            emulation_on: bool, executor: Executor) -> dict[str, Any]:
    measured = measured_step_ms(summaries) if summaries else math.nan
    banned = sorted({r for f in ranks for _, r in f["bans"]})
    flags = sum(f["verification"].get("flags", 0) for f in ranks)
    losses = [round(s.loss, 6) if math.isfinite(s.loss) else None for s in summaries]
    return {"plan": os.fspath(opts.plan), "model": plan.model.spec, "schedule": plan.schedule,
            "num_ranks": plan.num_ranks, "steps": len(summaries), "emulated": emulation_on,
            "emulate_slowdown": opts.emulate_slowdown if emulation_on else 1.0,
            "predicted_step_ms": plan.predicted.step_ms, "measured_step_ms": measured,
            "step_ms": [round(s.step_ms, 3) for s in summaries], "cpu_ms": [round(s.cpu_ms, 3) for s in summaries],
            "losses": losses,
            "final_loss": losses[-1] if losses else None, "dropped": [s.dropped for s in summaries],
            "banned": banned, "flags": flags, "attacks": list(opts.attacks), "ranks": ranks,
            "verified_boundaries": [v.boundary for v in plan.verifiers] if opts.verify else [],
            # Steps in which no microbatch trained (all dropped), this run and the runs it resumed.
            "untrained_steps": list(executor.untrained_steps)}


def _write_json(path: str, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def _dump(folder: str, rank: int, ex: Executor) -> None:
    """Final parameters, last-step gradients and losses of this rank (for comparing with a reference)."""
    os.makedirs(folder, exist_ok=True)
    params = {n: p.detach().cpu().clone() for n, p in ex.stage.parameters()} if ex.stage is not None else {}
    grads = {n: g.cpu() for n, g in ex.last_grads.items()}
    torch.save({"rank": rank, "stage": ex.info.stage, "params": params, "grads": grads,
                "losses": list(ex.step_losses)}, os.path.join(folder, f"rank{rank}.pt"))


# --------------------------------------------------------------------------- entry
def write_error(rank: int, exc: BaseException) -> None:
    """Leave this rank's error where the local launcher looks for it (STAGEWISE_ERROR_DIR)."""
    folder = os.environ.get("STAGEWISE_ERROR_DIR")
    if not folder:
        return
    record = {"rank": rank, "kind": type(exc).__name__, "error": str(exc),
              "peer": getattr(exc, "peer", None)}
    if isinstance(exc, RankBannedError):
        record["bans"] = [n.to_dict() for n in exc.notices]
        record["hosts"] = {str(r): h for r, h in exc.hosts.items()}
        record["fix"] = exc.fix
    _write_json(os.path.join(folder, f"rank{rank}.json"), record)


def main(argv: list[str] | None = None) -> int:
    opts = parse_worker_args(argv)
    env = RankEnv.from_environ()
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
