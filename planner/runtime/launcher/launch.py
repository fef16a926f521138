"""Run a plan on this machine: one process per rank, and a clear verdict if any rank fails.

``launch(opts)`` checks everything it can before a process starts (the plan
file, the attack specs, the plan's fingerprint against the model rebuilt from
its spec), then starts ``python -m planner.runtime.launcher.worker`` once per rank with
the environment ``torchrun`` would set (so the worker is the same code under
both). It follows rank 0's progress events and returns rank 0's result.

If a rank fails, the others fail too within the process-group timeout (each
names the peer it lost); the launcher stops whatever still runs, finds the
root cause (a rank that died, raised, or hung) and raises one
:class:`RankFailureError` naming it. A run the verifiers stopped by banning a rank
raises :class:`RunBanned` instead: which rank, its host, its first flagged step and
the ban step, and rank 0's result up to the ban.

``stop_at_checkpoint`` (a host joins, ``planner.runtime.launcher.elastic``) is polled while the ranks run; once it
says yes, the launcher leaves a stop file the ranks read at their next checkpoint, and they all stop right
after it is complete, cleanly (rank 0's result says ``stopped_at_checkpoint``): no step after the
checkpoint is started, so nothing trained is thrown away.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import InvalidInputError, RankFailureError
from planner.integrity.attacks import parse_attack
from planner.integrity.hooks import validate_attacks
from planner.outputs import write_atomic
from planner.runtime.data import check_data, parse_data_spec
from planner.runtime.launcher import hosts
from planner.runtime.launcher.membership import load_signed_plan, operator_trust
from planner.runtime.options import (
    EVENT_PREFIX,
    RunOptions,
    check_accumulate,
    check_model_allowed,
    is_factory_spec,
    refuse_onnx_model,
)
from planner.runtime.rank.audit_state import audited_stages
from planner.runtime.rank.rank_setup import check_model, check_pretrained
from planner.runtime.recovery import checkpoint
from planner.runtime.recovery.rank_checkpoint import STOP_ENV
from planner.runtime.wire.bans import BanNotice, RankBannedError
from planner.runtime.wire.control import CONTROL_RANK
from planner.secret import run_secret

_KILL_GRACE_S = 5.0


# --------------------------------------------------------------------------- preflight
def _check_forgers(plan, opts: RunOptions) -> None:
    """An ``--attack ...,dir=inputs`` forges the inputs a replica forwards its auditor: only a replica of a
    stage audited from signed inputs forwards any (elsewhere the attack would do nothing, silently)."""
    forgers = [s for s in opts.attacks if parse_attack(s).direction == "inputs"]
    if not forgers:
        return
    verifying = opts.verify and plan.policy.enabled and bool(plan.verifiers)
    stages = audited_stages(plan, every=opts.audit_every, verifying=verifying)
    replicas = sorted({r for st in stages.values() if st.signed_by for r in st.replicas})
    for s in forgers:
        if parse_attack(s).rank not in replicas:
            raise InvalidInputError(f"--attack {s!r}", expected="dir=inputs on a replica of a stage audited from "
                                    f"signed inputs (ranks {replicas or 'none in this plan and run'})",
                                    found=f"rank {parse_attack(s).rank}",
                                    fix="attack that rank's outputs (dir=act) or name a replica of a signed-audited stage")


def preflight(opts: RunOptions):
    """Everything checkable before a process starts; returns the plan."""
    key = run_secret(opts.secret_file)
    plan, _ = load_signed_plan(opts.plan, key, operator=operator_trust(opts))  # as signed, before anything runs
    refuse_onnx_model(plan.model.spec)
    check_model_allowed(plan.model.spec, opts.model)  # before anything imports the model
    validate_attacks(opts.attacks, plan.num_ranks)
    _check_forgers(plan, opts)
    if opts.fault is not None and opts.fault.rank >= plan.num_ranks:
        raise InvalidInputError("--fault rank", expected=f"< {plan.num_ranks}", found=str(opts.fault.rank))
    bundle, _ = check_model(plan, seed=opts.seed, model=opts.model)
    check_pretrained(plan, opts, bundle.module)  # saved weights that do not fit the config: before any rank starts
    check_data(bundle, kind=opts.data, seq=plan.model.seq)  # a bad --data file fails here, not on a rank
    if opts.eval_data is not None:
        check_data(bundle, kind=opts.eval_data, seq=plan.model.seq)
    check_accumulate(opts, verifying=opts.verify and plan.policy.enabled and bool(plan.verifiers))
    if opts.checkpoint_dir is not None:
        checkpoint.check_folder(opts.checkpoint_dir, resume=opts.resume)
    if opts.resume:
        done = checkpoint.latest(opts.checkpoint_dir, fingerprint=plan.model.fingerprint, key=key).step
        if done + 1 >= opts.steps:
            raise InvalidInputError(f"--resume at step {done + 1}", expected=f"fewer than --steps ({opts.steps})",
                                    found=f"the checkpoint of step {done} is already the last",
                                    fix=f"raise --steps above {done + 1}")
    return plan


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- launch
@dataclass(slots=True)
class _Rank:
    rank: int
    proc: subprocess.Popen
    log_path: Path
    killed: bool = False


def launch(opts: RunOptions, *, on_event: Callable[[dict[str, Any]], None] | None = None,
           log_dir: str | os.PathLike | None = None,
           stop_at_checkpoint: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Run ``opts.plan`` locally; return rank 0's result (step times, losses, predicted vs measured).
    ``stop_at_checkpoint``: see the module docstring."""
    started = time.time()  # a report older than this is an earlier run's
    plan = preflight(opts)
    run_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="stagewise-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("rank*.json"):  # a reused --log-dir's (or a re-planned run's) earlier error records
        stale.unlink()
    stop_path = run_dir / "stop-at-checkpoint"
    stop_path.unlink(missing_ok=True)
    result_path = run_dir / "result.json"
    env = _base_env(opts, run_dir, result_path)
    if stop_at_checkpoint is not None:
        env[STOP_ENV] = str(stop_path)
    ranks: list[_Rank] = []
    previous = _stop_on_sigterm()
    try:
        ranks.extend(_start(r, plan.num_ranks, opts, env, run_dir) for r in range(plan.num_ranks))
        events: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_read_events, args=(ranks[0].proc.stdout, events), daemon=True)
        reader.start()
        poll = None if stop_at_checkpoint is None else _stop_asker(stop_path, stop_at_checkpoint)
        _supervise(ranks, events, on_event, opts.timeout_s, run_dir, poll=poll)
        reader.join(timeout=5)
        _drain(events, on_event)
        failures = [r for r in ranks if r.proc.returncode != 0]
        banned = _banned(run_dir, result_path)
        if banned is not None:
            raise banned  # rank 0's report already says so
        if failures:
            hints = [f"see the rank logs in {run_dir}" if log_dir else "",
                     f"to go on without the failed rank's host: stagewise replan {opts.plan} --exclude HOST -o "
                     f"NEW.json, then stagewise run NEW.json --resume --checkpoint-dir {opts.checkpoint_dir}"
                     if opts.checkpoint_dir else ""]
            root, cause = root_cause(ranks, run_dir, opts.timeout_s)
            error = RunFailure(cause, rank=root, fix="; ".join(h for h in hints if h) or None)
            _failure_report(opts, str(error), started=started)
            raise error
        return json.loads(result_path.read_text(encoding="utf-8"))
    except KeyboardInterrupt:
        _failure_report(opts, "interrupted (SIGINT or SIGTERM): every rank was stopped", started=started,
                        interrupted=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if not log_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def _stop_on_sigterm():
    """SIGTERM stops the launcher as Ctrl-C does, so its ranks are stopped and its folder removed (the
    default would end this process at once and orphan them). Returns the handler to restore."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _failure_report(opts: RunOptions, error: str, *, started: float, interrupted: bool = False) -> None:
    """A failed run still leaves a report (``--report``): what went wrong, beside the steps it finished
    (rank 0 rewrites the report as the run goes; an earlier run's report is not taken for this one's)."""
    if not opts.report:
        return
    record: dict[str, Any] = {}
    try:
        path = Path(opts.report)
        earlier = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_mtime >= started else None
        if isinstance(earlier, dict) and earlier.get("in_progress"):
            record = earlier
    except (OSError, ValueError):
        pass
    record.update({"plan": os.fspath(opts.plan), "failed": True, "interrupted": interrupted, "error": error})
    record.pop("in_progress", None)
    write_atomic(opts.report, json.dumps(record, indent=1) + "\n")


def _base_env(opts: RunOptions, run_dir: Path, result_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    cwd = os.getcwd()
    # Factories the user named (--model, --data, --loss MODULE:FN) may sit next to the caller: only then is
    # the current folder on the workers' path (python -P below keeps it off otherwise).
    named = [s for s in (opts.model, opts.loss) if s and is_factory_spec(s)]
    named += [d for d in (opts.data, opts.eval_data) if d and parse_data_spec(d).kind == "factory"]
    if named:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH", "")) if p)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "STAGEWISE_EVENTS": "1",
                "STAGEWISE_ERROR_DIR": str(run_dir), "STAGEWISE_RESULT": str(result_path),
                "OMP_NUM_THREADS": str(opts.threads), "PYTHONUNBUFFERED": "1", **hosts.local_run_env()})
    return env


def _start(rank: int, world: int, opts: RunOptions, base_env: dict[str, str], run_dir: Path) -> _Rank:
    env = {**base_env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world)}
    log_path = run_dir / f"rank{rank}.log"
    log = log_path.open("w", encoding="utf-8")
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # no implicit current folder on sys.path
    cmd = [sys.executable, *safe_path, "-m", "planner.runtime.launcher.worker", *opts.worker_argv()]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if rank == 0 else log, stderr=log,
                            text=True, bufsize=1)
    log.close()  # the child holds its own descriptor
    return _Rank(rank=rank, proc=proc, log_path=log_path)


def _read_events(stream, events: queue.Queue) -> None:
    for line in stream:
        if line.startswith(EVENT_PREFIX):
            events.put(json.loads(line[len(EVENT_PREFIX):]))
        else:
            sys.stdout.write(line)


def _drain(events: queue.Queue, on_event: Callable[[dict[str, Any]], None] | None) -> None:
    while True:
        try:
            event = events.get_nowait()
        except queue.Empty:
            return
        if on_event is not None:
            on_event(event)


def _stop_asker(stop_path: Path, wanted: Callable[[], bool]) -> Callable[[], None]:
    """What the supervisor polls: leave the stop file once ``wanted`` says so (and ask no more)."""

    def poll() -> None:
        if not stop_path.exists() and wanted():
            stop_path.touch()

    return poll


def _supervise(ranks: list[_Rank], events: queue.Queue, on_event, timeout_s: float, run_dir: Path,
               poll: Callable[[], None] | None = None) -> None:
    """Wait for every rank; once one fails, stop the rest when they are hung (``poll``: called each turn).

    A rank still running after a failure is stopped when another rank's error
    names it as the peer it lost (it hung), or at the latest after the
    timeout plus a grace period (it had every chance to notice).
    """
    first_failure: float | None = None
    while any(r.proc.poll() is None for r in ranks):
        _drain(events, on_event)
        if poll is not None and first_failure is None:
            poll()
        if first_failure is None and any(r.proc.returncode not in (None, 0) for r in ranks):
            first_failure = time.monotonic()
        if first_failure is not None:
            overdue = time.monotonic() - first_failure > timeout_s + _KILL_GRACE_S
            blamed = _blamed(run_dir)
            for r in ranks:
                if r.proc.poll() is None and (overdue or r.rank in blamed):
                    r.killed = True
                    r.proc.kill()
                    r.proc.wait()
        time.sleep(0.05)


def _records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The error records the ranks left (rank -> {kind, error, peer}), each from its own file: a record
    that claims another rank's name is not that rank's."""
    out: dict[int, dict[str, Any]] = {}
    for path in run_dir.glob("rank*.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue  # being written right now: read it on the next poll
        if isinstance(record, dict) and path.stem == f"rank{record.get('rank')}":
            out[int(record["rank"])] = record
    return out


def _blamed(run_dir: Path) -> set[int]:
    return {rec["peer"] for rec in _records(run_dir).values() if rec.get("peer") is not None}


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:240] if lines else ""


_LOST_PEER = ("RankFailureError", "ProtocolError")  # errors that name another rank as the cause


class RunFailure(RankFailureError):
    """A run stopped by a rank's failure; ``rank`` is the one whose failure stopped it."""

    def __init__(self, what: str, *, rank: int, fix: str | None = None) -> None:
        super().__init__(what, fix=fix)
        self.rank = rank


class RunBanned(RunFailure):
    """A run the verifiers stopped by banning ``notices``' ranks (on ``hosts``); ``result`` is rank 0's
    result up to the ban (losses, verification events), when it wrote one."""

    def __init__(self, error: RankBannedError, *, result: dict[str, Any] | None) -> None:
        super().__init__(error.what, rank=error.notices[0].rank, fix=error.fix)
        self.notices, self.hosts, self.result = error.notices, error.hosts, result


def _banned(run_dir: Path, result_path: Path) -> RunBanned | None:
    """The ban that stopped the run, from the control rank's error record alone (every rank leaves the
    same one, but only the control rank's comes from a trusted process)."""
    record = _records(run_dir).get(CONTROL_RANK)
    if record is not None and record.get("kind") == RankBannedError.__name__ and record.get("bans"):
        notices = tuple(BanNotice(**{k: int(v) for k, v in n.items()}) for n in record["bans"])
        hosts = {int(r): str(h) for r, h in record.get("hosts", {}).items()}
        error = RankBannedError(notices, hosts=hosts, fix=record.get("fix"))
        result = json.loads(result_path.read_text(encoding="utf-8")) if result_path.is_file() else None
        return RunBanned(error, result=result)
    return None


def diagnose(ranks: Sequence[_Rank], run_dir: Path, timeout_s: float) -> str:
    """One line naming the root cause: a rank that died, raised, or hung; then what the others saw."""
    return root_cause(ranks, run_dir, timeout_s)[1]


def root_cause(ranks: Sequence[_Rank], run_dir: Path, timeout_s: float) -> tuple[int, str]:
    """The rank whose failure stopped the run, and :func:`diagnose`'s line."""
    records = _records(run_dir)
    died = [r for r in ranks if r.proc.returncode not in (0, None) and not r.killed and r.rank not in records]
    raised = [r for r in ranks if r.rank in records and records[r.rank]["kind"] not in _LOST_PEER]
    hung = [r for r in ranks if r.killed]
    broke = [rec for rec in records.values() if rec["kind"] == "ProtocolError" and rec.get("peer") is not None]
    if broke:  # a rank that sent what the protocol forbids is at fault, whatever else failed after it
        root = ranks[broke[0]["peer"]]
        cause = f"rank {root.rank} broke the protocol ({broke[0]['error'].split(';')[0]})"
    elif died:
        root = died[0]
        code = root.proc.returncode
        detail = _last_line(root.log_path)
        if code == 1 and detail:  # an uncaught Python exception: its last traceback line says what
            cause = f"rank {root.rank} failed: {detail.removeprefix(f'[rank{root.rank}]:').strip()}"
        else:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            cause = f"rank {root.rank} died ({how}{': ' + detail if detail else ''})"
    elif raised:
        root = raised[0]
        cause = f"rank {root.rank} failed: {records[root.rank]['error']}"
    elif hung:
        root = hung[0]
        cause = f"rank {root.rank} hung (no progress within the {timeout_s:g} s timeout; stopped)"
    else:
        blamed = [rec.get("peer") for rec in records.values() if rec.get("peer") is not None]
        root_rank = max(set(blamed), key=blamed.count) if blamed else min(records, default=0)
        root = ranks[root_rank]
        cause = f"rank {root_rank} stopped answering" + (f": {records[root_rank]['error']}"
                                                         if root_rank in records else "")
    others = [r.rank for r in ranks if r.rank != root.rank and r.proc.returncode != 0]
    seen = f"; ranks {others} stopped after losing their peers" if others else ""
    return root.rank, cause + seen
