"""A run that goes on when a host fails, a rank is banned or a host joins: re-plan and resume.

``launch`` stops every rank when one dies, hangs or raises, and names the rank whose failure stopped
the run (:class:`planner.runtime.launcher.launch.RunFailure`). Here that rank's host is excluded, the solver
plans again on the hosts that are left (``planner.replan.replan``: a fresh solve under the same time
limit, warm-started from the old plan, the reason recorded, the plan signed), and the run resumes on the
new plan from the newest complete checkpoint, re-sharded by parameter name onto the new stages, so no
finished step is lost. Before it re-plans, the launcher makes the state the surviving ranks left (their
last completed step) that newest checkpoint when it is whole and newer (:mod:`planner.runtime.recovery.survivors`):
then no step is redone; else it discards it and says why in the run's history.

A ban (:class:`planner.runtime.launcher.launch.RunBanned`) is handled the same way, except that the run
resumes from the last clean checkpoint: the newest one taken before the banned sender's first
flagged step (rank 0 set the later ones aside when it stopped), or from the start if there is none.
The banned host is excluded, and with it its whole trust domain when the plan's policy says
``ban_excludes_domain`` (``stagewise plan --ban-excludes-domain``: one operator's machines answer for
an attack from one of them); the reason names the domain.

Joins. The launcher watches the run's join folder (``<checkpoint-dir>/joins``, or ``join_dir``) for
requests that ``stagewise join`` writes (:mod:`planner.runtime.recovery.joins`: signed with the run secret,
data only). A bad request is reported and set aside (``.rejected``); the run goes on. While a valid one
waits, the launcher asks the ranks to stop after their next checkpoint (``launch(stop_at_checkpoint=)``):
they stop together right after its manifest is written, before starting the next step, so no work is
thrown away. The launcher then re-plans with the hosts that asked (``replan(readmit_hosts=,
add_hosts=, event="join")``: the same time limit and warm start as the other re-plans, signed), marks
the requests ``.joined`` and resumes from that checkpoint on the new plan. If that re-plan fails, the
requests are rejected and the run resumes on the plan it had. Joins do not count against
``max_replans``: that bounds how often a run recovers from faults, which can recur on their own; a join
happens only on a request signed by someone who holds the run secret.

Procedure (one machine, ``stagewise run``): start the run with ``--checkpoint-dir DIR`` and
``--replan-on-failure N`` (or ``--join-dir``); when a host is ready (an excluded one repaired, or a new
one), ``stagewise join PLAN --host NAME --checkpoint-dir DIR`` (re-admission) or ``stagewise join PLAN
--describe HOST.yaml --checkpoint-dir DIR`` (a new host, one host entry of a cluster file), PLAN being
the plan the run is on now (the last ``DIR/plan-replan-N.json`` it printed, else the one it started
with). The run plans the host in at its next checkpoint; its summary lists the join. Across hosts,
torchrun's elastic rendezvous does the same when a host joins (one of the cluster that comes back, or
a new one a signed request in ``DIR/joins`` describes: ``planner.runtime.launcher.torchrun_elastic``), redoing
the work since the newest checkpoint: torchrun restarts every worker when a node joins.
"""
from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from planner.replan import replan
from planner.errors import InvalidInputError, PlannerError
from planner.outputs import check_writable, write_atomic
from planner.plan_load import load_plan
from planner.runtime.launcher.launch import RunBanned, RunFailure, _stop_on_sigterm, launch
from planner.runtime.options import RunOptions
from planner.runtime.recovery import checkpoint, joins, retention, survivors
from planner.runtime.wire.bans import describe
from planner.secret import run_secret


def launch_replanning(opts: RunOptions, *, max_replans: int, time_limit_s: float = 30.0,
                      on_event: Callable[[dict[str, Any]], None] | None = None,
                      log_dir: str | None = None, join_dir: str | None = None) -> dict[str, Any]:
    """``launch(opts)``; after a failure with a checkpoint to resume from, or a ban, up to ``max_replans``
    times: exclude the failed or banned rank's host, re-plan, resume; at the checkpoint after a valid join
    request (in ``join_dir``, default ``<checkpoint-dir>/joins``): re-plan with the host, resume. The result
    lists the re-plans (``replans``) and says what happened (``recovered``, ``joined``, ``joins_rejected``,
    ``joins_waiting``: valid requests the run ended before acting on)."""
    if opts.checkpoint_dir is None:
        raise InvalidInputError("--replan-on-failure or --join-dir", expected="--checkpoint-dir DIR (a re-planned "
                                "run resumes from its checkpoints)", found="no checkpoint folder",
                                fix="add --checkpoint-dir DIR [--checkpoint-every N]")
    key = run_secret(opts.secret_file)
    folder = Path(join_dir) if join_dir is not None else Path(opts.checkpoint_dir) / joins.FOLDER
    check_writable(folder / "request.json", what="--join-dir")
    folder.mkdir(parents=True, exist_ok=True)  # where the operator drops requests: there from the start
    replans: list[dict[str, Any]] = []
    rejected: list[dict[str, str]] = []
    legs = _Legs(on_event)
    clock = _FirstStep(legs)
    previous = _stop_on_sigterm()  # a SIGTERM while re-planning, between launches, is an interrupt too
    try:
        return _legs_until_done(opts, key, folder, replans, rejected, legs, clock, max_replans, time_limit_s,
                                log_dir)
    except (PlannerError, KeyboardInterrupt) as stop:
        _stopped_report(opts, stop, replans, legs)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _legs_until_done(opts: RunOptions, key: bytes, folder: Path, replans: list[dict[str, Any]],
                     rejected: list[dict[str, str]], legs: _Legs, clock: _FirstStep, max_replans: int,
                     time_limit_s: float, log_dir: str | None) -> dict[str, Any]:
    """Run leg after leg (a launch on one plan) until one finishes; see :func:`launch_replanning`."""
    while True:
        plan = load_plan(opts.plan)
        watcher = joins.JoinWatcher(folder=folder, plan=plan, key=key, rejected=rejected)
        survivors.clear(opts.checkpoint_dir)  # an earlier leg's survivor files are no state of this one
        legs.begin(opts, ranks=plan.num_ranks)
        before = len(replans)
        try:
            result = launch(opts, on_event=clock, log_dir=log_dir, stop_at_checkpoint=watcher.waiting)
        except RunBanned as banned:
            legs.end("ban")
            if _recoveries(replans) >= max_replans:
                raise
            opts = _replan(opts, key, replans, _ban_event(opts, banned), time_limit_s)
        except RunFailure as failure:
            old = load_plan(opts.plan)
            # Before the check below: the survivors' state may be the run's only checkpoint.
            kept = survivors.settle(opts.checkpoint_dir, old, last_step=opts.steps - 1, key=key,
                                    audit_every=opts.audit_every, verify=opts.verify)
            legs.end("failure", reached=kept.reached)
            said = f"{kept.why}: resuming from it" if kept.step is not None else \
                f"survivor checkpoint discarded: {kept.why}"
            print(f"stagewise run: {said}", file=sys.stderr, flush=True)
            if _recoveries(replans) >= max_replans or not checkpoint.complete_steps(opts.checkpoint_dir):
                raise
            event = {"after": failure.what, "excluded": old.ranks[failure.rank].host, "event": "failure",
                     **kept.entry()}
            opts = _replan(opts, key, replans, event, time_limit_s)
        except KeyboardInterrupt:
            legs.end("interrupted")
            raise
        except PlannerError:  # refused before its ranks started (preflight)
            legs.end("failed")
            raise
        else:
            if result.get("stopped_at_checkpoint") is None:
                legs.end("finished")
                return _summary(opts, result, replans, watcher, legs)
            legs.end("join")
            opts = _join(opts, key, replans, watcher, time_limit_s, clock, step=result["stopped_at_checkpoint"])
        legs.resumed(_resume_step(opts), entry=replans[-1] if len(replans) > before else None)


def _resume_step(opts: RunOptions) -> int | None:
    """The step after which the next leg starts: its newest checkpoint when it resumes, else none."""
    steps = checkpoint.complete_steps(opts.checkpoint_dir) if opts.resume else []
    return steps[-1] if steps else None


def _recoveries(replans: list[dict[str, Any]]) -> int:
    """The re-plans that count against ``max_replans``: those after a failure or a ban, not joins."""
    return sum(1 for r in replans if r["event"] != "join")


def _summary(opts: RunOptions, result: dict[str, Any], replans: list[dict[str, Any]],
             watcher: joins.JoinWatcher, legs: _Legs) -> dict[str, Any]:
    """The last leg's result, with every leg and plan change of the run and what became of the join requests."""
    result = {**result, **_whole_run(replans, legs)}
    recovered = [r for r in replans if r["event"] != "join"]
    joined = [r for r in replans if r["event"] == "join"]
    if recovered:
        result["recovered"] = "; ".join(f"{r['after']} -> re-planned without {r['excluded']}, resumed after step "
                                        f"{r['resumed_after_step']}{resumed_from(r)}" for r in recovered)
    if joined:
        result["joined"] = "; ".join(f"{r['after']} -> re-planned with {', '.join(r['joined'])}, resumed after "
                                     f"step {r['resumed_after_step']}" for r in joined)
    waiting = [str(j.path) for j in watcher.take()]  # the run ended before a checkpoint could take them
    if waiting:
        result["joins_waiting"] = waiting
    if watcher.rejected:
        result["joins_rejected"] = list(watcher.rejected)
    if opts.report:  # rank 0 wrote the last leg's report only
        write_atomic(opts.report, json.dumps(result, indent=1, default=str) + "\n")
    return result


def _whole_run(replans: list[dict[str, Any]], legs: _Legs) -> dict[str, Any]:
    """What covers every leg of the run: the legs, the re-plans, the steps run in all and those run again."""
    done = legs.records()
    return {"replans": replans, "legs": done, "steps_run": sum(leg["steps"] for leg in done),
            "steps_redone": sum(leg["redone_steps"] for leg in done)}


def _stopped_report(opts: RunOptions, stop: BaseException, replans: list[dict[str, Any]], legs: _Legs) -> None:
    """A run that stops for good (a failure past ``max_replans``, a re-plan that fails, an interrupt) leaves a
    report of every leg: the last leg's own (the launcher's or rank 0's, when written in this run) with the
    legs and re-plans, and what stopped it."""
    if not opts.report:
        return
    record: dict[str, Any] | None = None
    try:
        path = Path(opts.report)
        earlier = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_mtime >= legs.started_s else None
        record = earlier if isinstance(earlier, dict) else None
    except (OSError, ValueError):
        pass
    if record is not None and legs.legs and record.get("plan") == legs.legs[-1]["plan"]:
        legs.caught_up(int(record.get("steps") or 0))  # its report can be ahead of the events a stop cut short
    interrupted = isinstance(stop, KeyboardInterrupt)
    ran = isinstance(stop, RunFailure) or len(legs.legs) > 1 or any(leg["steps"] for leg in legs.legs)
    if record is None and not (interrupted or ran):
        return  # refused before any rank started, as a plain run's bad input leaves no report
    record = record or {"plan": str(legs.legs[-1]["plan"]) if legs.legs else None}
    record.pop("in_progress", None)
    record.update(failed=True, interrupted=interrupted, **_whole_run(replans, legs),
                  error="interrupted (SIGINT or SIGTERM): every rank was stopped" if interrupted else str(stop))
    write_atomic(opts.report, json.dumps(record, indent=1, default=str) + "\n")


def resumed_from(entry: dict[str, Any]) -> str:
    """Where a recovery's state came from, when the survivors of a failure had a say."""
    if "survivors" in entry:
        return f" from the survivors' state ({entry['survivors_note']})"
    if "survivors_discarded" in entry:
        return f" from the newest checkpoint (survivor checkpoint discarded: {entry['survivors_discarded']})"
    return ""


def _ban_event(opts: RunOptions, banned: RunBanned) -> dict[str, Any]:
    """What a ban means for the re-plan: the banned hosts, the reason, where the clean state is."""
    plan = load_plan(opts.plan)
    hosts = sorted({plan.ranks[n.rank].host for n in banned.notices})
    clean = retention.set_aside_from(retention.run_lookback(plan, opts), banned.notices)
    checkpoint.set_aside(opts.checkpoint_dir, from_step=clean)  # rank 0 did it when it stopped; once more is a no-op
    reason = "; ".join(describe(n, plan.ranks[n.rank].host) for n in banned.notices)
    # The policy may hold a whole trust domain (one operator's machines) answerable for its host's attack.
    domains = sorted({h.trust for h in plan.effective_cluster().hosts if h.name in hosts}
                     if plan.policy.ban_excludes_domain else ())
    excluded = ", ".join(hosts + [f"trust domain {d}" for d in domains])
    return {"after": reason, "excluded": excluded, "hosts": hosts, "domains": domains, "event": "ban",
            "banned": [n.to_dict() for n in banned.notices]}


def _replan(opts: RunOptions, key: bytes, replans: list[dict[str, Any]], event: dict[str, Any],
            time_limit_s: float) -> RunOptions:
    """Re-plan without the event's hosts, record it in ``replans``, and return the options that resume."""
    plan = load_plan(opts.plan)
    hosts = event.pop("hosts", [event["excluded"]])
    new = replan(plan, exclude_hosts=hosts, exclude_domains=event.pop("domains", ()), reason=event["after"],
                 event=event["event"], time_limit_s=time_limit_s)
    return _adopt(opts, key, replans, new, event, change=f"re-planned without host {event['excluded']}")


def _join(opts: RunOptions, key: bytes, replans: list[dict[str, Any]], watcher: joins.JoinWatcher,
          time_limit_s: float, clock: _FirstStep, *, step: int) -> RunOptions:
    """The ranks stopped after the checkpoint of ``step`` for the join requests waiting: re-plan with their
    hosts and return the options that resume from that checkpoint (on the same plan if the requests are
    gone or the re-plan fails). The join's entry times it: request -> checkpoint complete (its manifest's
    time) -> ranks exited -> re-plan -> first step reported on the new plan."""
    stopped_s = time.time()
    same = dataclasses.replace(opts, resume=True)
    waiting = watcher.take()  # checked again, now: one may have been withdrawn
    if not waiting:
        print("stagewise run: the join requests were withdrawn; resuming on the same plan", file=sys.stderr,
              flush=True)
        return same
    hosts = [j.request.host for j in waiting]
    reason = "; ".join(j.request.describe() for j in waiting)
    start = time.perf_counter()
    try:
        new = replan(load_plan(opts.plan), readmit_hosts=[j.request.host for j in waiting if j.request.readmission],
                     add_hosts=[j.request.new_host for j in waiting if not j.request.readmission], reason=reason,
                     event="join", time_limit_s=time_limit_s)
    except PlannerError as exc:
        for j in waiting:
            watcher.reject(j.path, f"re-planning with {', '.join(hosts)} failed: {exc}")
        return same
    replan_s = time.perf_counter() - start
    watcher.accept(waiting)
    written = min(j.written_s for j in waiting)
    taken_s = (checkpoint.step_folder(opts.checkpoint_dir, step) / checkpoint.MANIFEST).stat().st_mtime
    entry = {"after": reason, "event": "join", "joined": hosts, "excluded": "",
             "request_to_checkpoint_s": round(taken_s - written, 3), "shutdown_s": round(stopped_s - taken_s, 3),
             "replan_s": round(replan_s, 3)}
    resumed = _adopt(opts, key, replans, new, entry, change=f"re-planned with {', '.join(hosts)}")
    clock.arm(entry, requested_s=written, replanned_s=time.time())
    return resumed


def _adopt(opts: RunOptions, key: bytes, replans: list[dict[str, Any]], new, event: dict[str, Any], *,
           change: str) -> RunOptions:
    """Save the re-planned ``new`` (signed) beside the checkpoints, record ``event`` in ``replans``, and
    return the options that resume on it."""
    path = Path(opts.checkpoint_dir) / f"plan-replan-{len(replans) + 1}.json"
    new.save(path, secret=key)
    steps = checkpoint.complete_steps(opts.checkpoint_dir)
    step = steps[-1] if steps else None  # no clean checkpoint: the new plan starts from the first step
    event.update({"plan": str(path), "ranks": new.num_ranks, "resumed_after_step": step,
                  "simulated_step_ms": round(new.predicted.step_ms, 3)})
    replans.append(event)  # its redone_steps: set by _Legs.resumed, once the leg it ends is counted
    where = f"resuming after step {step}" if steps else "starting again from step 0 (no clean checkpoint)"
    print(f"stagewise run: {event['after']}; {change} ({new.num_ranks} ranks, {path}); {where}", file=sys.stderr,
          flush=True)
    # The new plan runs from the checkpoint; a rehearsed fault or attack named a rank of the old one.
    return dataclasses.replace(opts, plan=str(path), resume=bool(steps), fault=None, attacks=())


class _Legs:
    """The run's legs (one launch each, on one plan): passes rank 0's events on and records, per leg, its
    plan, the steps it ran (``first_step`` .. ``last_step``: the newest step it completed, by rank 0's reports
    or, after a failure, the survivors' notes, which are ahead of rank 0's reports by a step), how it ended,
    and ``redone_steps``: how many of its steps the next leg trains again (those after its resume step)."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None) -> None:
        self.on_event = on_event
        self.started_s = time.time()  # a report older than this is an earlier run's
        self.legs: list[dict[str, Any]] = []
        self.reported: list[int] = []

    def begin(self, opts: RunOptions, *, ranks: int) -> None:
        self.reported = []
        after = _resume_step(opts)
        self.legs.append({"leg": len(self.legs) + 1, "plan": str(opts.plan), "ranks": ranks,
                          "resumed_after_step": after, "first_step": 0 if after is None else after + 1,
                          "last_step": None, "steps": 0, "ended": "running", "redone_steps": 0})

    def end(self, how: str, *, reached: int | None = None) -> None:
        """The current leg ended ``how``; ``reached``: the newest step a survivor of a failure completed."""
        leg = self.legs[-1]
        last = max((s for s in (*self.reported, reached) if s is not None), default=None)
        if last is not None and last >= leg["first_step"]:
            leg.update(last_step=last, steps=last - leg["first_step"] + 1)
        leg["ended"] = how

    def caught_up(self, steps: int) -> None:
        """Rank 0's own report says the current leg completed ``steps`` steps: at least that many ran."""
        leg = self.legs[-1]
        if steps > leg["steps"]:
            leg.update(steps=steps, last_step=leg["first_step"] + steps - 1)

    def resumed(self, step: int | None, *, entry: dict[str, Any] | None) -> None:
        """The next leg resumes after ``step`` (None: from the start); ``entry``: the re-plan between them."""
        leg = self.legs[-1]
        start = step + 1 if step is not None else 0
        leg["redone_steps"] = 0 if leg["last_step"] is None else max(0, leg["last_step"] - start + 1)
        if entry is not None:
            entry["redone_steps"] = leg["redone_steps"]

    def records(self) -> list[dict[str, Any]]:
        return [dict(leg) for leg in self.legs]

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("event") == "step":
            self.reported.append(int(event["step"]))
        if self.on_event is not None:
            self.on_event(event)


class _FirstStep:
    """Passes rank 0's events on; after a join, records in its entry when the first step on the new plan
    was reported: ``restart_s`` after the re-plan (new processes, rendezvous, reload, that step) and
    ``request_to_first_step_s`` after the request was written."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None) -> None:
        self.on_event = on_event
        self.armed: tuple[dict[str, Any], float, float] | None = None

    def arm(self, entry: dict[str, Any], *, requested_s: float, replanned_s: float) -> None:
        self.armed = (entry, requested_s, replanned_s)

    def __call__(self, event: dict[str, Any]) -> None:
        if self.armed is not None and event.get("event") == "step":
            entry, requested_s, replanned_s = self.armed
            now = time.time()
            entry.update(restart_s=round(now - replanned_s, 3), request_to_first_step_s=round(now - requested_s, 3))
            self.armed = None
        if self.on_event is not None:
            self.on_event(event)
