"""Resume from the survivors' state: when a peer dies or hangs, the ranks left alive hold a state newer
than the newest checkpoint; kept, it lets the re-planned run redo nothing (Bamboo's and Oobleck's idea,
made simple: no redundant computation, only what the survivors already hold).

Rank side. :class:`Tracker` follows a rank's steps: the last one it completed, the small state right
after it (CPU RNG, fp16 loss scale, the steps that trained nothing), and whether the next step's
optimizer update has begun since (an optimizer step pre-hook). When the rank's run loop stops because
a peer failed (``RankFailureError``, never a ban), :func:`leave` writes its file of a *survivor
checkpoint* for that step into ``<checkpoint-dir>/survivors/rank{r}.safetensors`` (the same format as a
checkpoint's rank file: parameters and optimizer state by name, safetensors, atomic), then a note
``rank{r}.json`` saying which step (or why it wrote none: it was inside its optimizer update, so its
parameters are those of neither step). Gradients of the step it was in are dropped: they are not state.

Launcher side. After the ranks have exited and before it re-plans, :func:`settle` reads the notes and
files (JSON and safetensors metadata: no code runs) and :func:`decide` accepts the survivor checkpoint
only when (a) every rank that wrote a file reports the same step, (b) every stage of the old plan has a
file (a stage whose only replica died cannot be recovered this way), (c) that step is newer than the
newest complete checkpoint. Accepted, the files move into ``step-N/`` and a manifest listing those ranks
marks it complete (``checkpoint.complete(ranks=...)``): the re-planned run resumes from it as from any
checkpoint. Otherwise the files are discarded and the newest complete checkpoint is used; either way the
decision's one line goes into the run's history. The folder is cleared before each leg of a run.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from planner.outputs import write_atomic
from planner.runtime.recovery import checkpoint, retention

if TYPE_CHECKING:
    from planner.plan import Plan
    from planner.runtime.rank.executor import Executor

FOLDER = "survivors"


# --------------------------------------------------------------------------- rank side
class Tracker:
    """A rank's last completed step, its small state right after it, and whether the next step's
    optimizer update has begun since (then the rank's parameters are no step's)."""

    def __init__(self, executor: Executor, *, first: int) -> None:
        self.executor, self.first = executor, first
        self.done = first - 1
        self.updating = False
        self._snapshot()
        if executor.optimizer is not None:
            executor.optimizer.register_step_pre_hook(self._began)

    def _began(self, *_: object) -> None:
        self.updating = True

    def completed(self, step: int) -> None:
        """Called right after ``run_step(step)`` returned: the rank's state is the one after ``step``."""
        self.done, self.updating = step, False
        self._snapshot()

    def _snapshot(self) -> None:
        # Cheap copies (a few KB): the next step changes these before its optimizer update, or without one.
        ex = self.executor
        self.rng = torch.get_rng_state()
        self.untrained = list(ex.untrained_steps)
        self.loss_scale = ex.scaler.state() if ex.scaler is not None else None


def leave(root: str | Path, tracker: Tracker, *, rank: int, fingerprint: str, params: dict[str, torch.Tensor],
          state: dict[str, Any], keep_before: int | None, unaudited_since: int | None = None) -> None:
    """A peer failed: write this rank's survivor file for its last completed step and its note (or only
    a note saying why it wrote none). ``state``: what a checkpoint keeps beside the tensors; its RNG,
    loss scale and untrained steps are taken as they were after that step. Never raises: the peer's
    failure is what the rank reports. ``unaudited_since``: the earliest step whose audits this rank (an
    auditor) had no passing verdict on; a state of that step or later is no step to resume from (an attacker
    could crash a peer to escape the verdict)."""
    folder = Path(root) / FOLDER
    note: dict[str, Any] = {"rank": rank, "step": None, "why": "", "keep_before": keep_before,
                            "unaudited_since": unaudited_since}
    own = folder / f"rank{rank}.safetensors"
    try:
        own.unlink(missing_ok=True)  # only what this call writes speaks for the rank
        if unaudited_since is not None and unaudited_since <= tracker.done:
            note["why"] = f"rank {rank} had no passing verdict on step {unaudited_since}'s audits"
        elif tracker.updating:
            note["why"] = f"rank {rank} had begun step {tracker.done + 1}'s optimizer update"
        elif tracker.done < tracker.first:
            note["why"] = f"rank {rank} had completed no step since the run (re)started"
        else:
            kept = {**state, "untrained_steps": tracker.untrained}
            if tracker.loss_scale is not None:
                kept["loss_scale"] = tracker.loss_scale
            checkpoint.write_rank_file(own, step=tracker.done, rank=rank,
                                       fingerprint=fingerprint, params=params, optimizer=tracker.executor.optimizer,
                                       state=kept, rng=tracker.rng)
            note["step"] = tracker.done
        write_atomic(folder / f"rank{rank}.json", json.dumps(note) + "\n")  # after the file: it vouches for it
    except Exception as exc:  # noqa: BLE001 - whatever went wrong here, the peer's failure is the error to report
        print(f"stagewise run: rank {rank}: could not leave its state for a resume ({exc})", file=sys.stderr,
              flush=True)


# --------------------------------------------------------------------------- launcher side
@dataclass(frozen=True, slots=True, kw_only=True)
class Note:
    """What a surviving rank said: the step its file holds, or None and why it wrote none."""

    rank: int
    step: int | None
    why: str = ""
    keep_before: int | None = None
    unaudited_since: int | None = None  # an auditor's earliest step without a passing verdict


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """``step``: the survivor checkpoint's step, now complete (None: not used); ``why``: one line;
    ``reached``: the newest step a surviving rank had completed (None: none said), which the resume
    redoes nothing beyond."""

    step: int | None
    ranks: tuple[int, ...] = ()
    why: str
    reached: int | None = None

    def entry(self) -> dict[str, Any]:
        """The re-plan history's fields for it."""
        if self.step is None:
            return {"survivors_discarded": self.why, "survivors_reached_step": self.reached}
        return {"survivors": {"step": self.step, "ranks": list(self.ranks)}, "survivors_note": self.why,
                "survivors_reached_step": self.reached}


def decide(notes: Sequence[Note], *, stage_of: Mapping[int, int | None], num_stages: int,
           newest: int | None, last_step: int, auditors: Collection[int] = ()) -> Decision:
    """Whether the survivors' files make a checkpoint to resume from (the module docstring's a, b, c).
    ``stage_of``: the old plan's stage of each rank (None: a verifier); ``newest``: the newest complete
    checkpoint's step (None: there is none); ``last_step``: the run's last (a resume needs a step left);
    ``auditors``: the trusted ranks whose audit verdicts may be out a step late: each must have left a note."""
    wrote = sorted((n for n in notes if n.step is not None), key=lambda n: n.rank)
    declined = "".join(f"; {n.why}" for n in notes if n.step is None and n.why)
    if not wrote:
        return Decision(step=None, why=f"no surviving rank left its state{declined}")
    steps = sorted({n.step for n in wrote})
    unvouched = _unvouched(notes, auditors, steps[-1])
    if unvouched:
        return Decision(step=None, why=f"{unvouched}: the survivors' state may hold an update no audit vouched for",
                        reached=steps[-1])
    if len(steps) > 1:
        each = ", ".join(f"rank {n.rank} after step {n.step}" for n in wrote)
        return Decision(step=None, why=f"the survivors stopped at different steps ({each})", reached=steps[-1])
    step = steps[0]
    covered = {stage_of.get(n.rank) for n in wrote}
    lost = [k for k in range(num_stages) if k not in covered]
    if lost:
        ranks = [r for r, k in sorted(stage_of.items()) if k in lost]
        return Decision(step=None, why=f"stage{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} left no "
                                       f"survivor file (ranks {ranks}){declined}", reached=step)
    if newest is not None and step <= newest:
        return Decision(step=None, why=f"the survivors' step {step} is no newer than the newest checkpoint "
                                       f"(step {newest})", reached=step)
    if step >= last_step:
        return Decision(step=None, why=f"the survivors had finished the last step ({step}): a resume needs one "
                                       "left to run", reached=step)
    ranks = tuple(n.rank for n in wrote)
    verifiers = [r for r, k in sorted(stage_of.items()) if k is None and r not in ranks]
    fresh = f"; verifier rank{'s' if len(verifiers) > 1 else ''} {', '.join(map(str, verifiers))} left no " \
            "state: the resumed run's monitor starts fresh" if verifiers else ""
    return Decision(step=step, ranks=ranks, why=f"ranks {', '.join(map(str, ranks))} left their state after step "
                                                f"{step}{fresh}", reached=step)


def _unvouched(notes: Sequence[Note], auditors: Collection[int], step: int) -> str:
    """Why the state after ``step`` is not vouched for by the audits (empty: it is)."""
    heard = {n.rank for n in notes}
    silent = sorted(set(auditors) - heard)
    if silent:
        return f"auditor rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} left no note"
    out = [n for n in notes if n.unaudited_since is not None and n.unaudited_since <= step]
    return "; ".join(f"rank {n.rank} had no passing verdict on step {n.unaudited_since}'s audits" for n in out)


def read_notes(root: str | Path, *, num_ranks: int, fingerprint: str) -> list[Note]:
    """The notes the ranks of a ``num_ranks``-rank plan left; a note whose file is missing or does not
    say the same step, rank and model counts as one that wrote none."""
    folder = Path(root) / FOLDER
    notes = []
    for rank in range(num_ranks):
        path = folder / f"rank{rank}.json"
        if not path.is_file():
            continue
        try:
            note = _parse(json.loads(path.read_text(encoding="utf-8")), rank)
        except (OSError, ValueError, TypeError, KeyError):
            notes.append(Note(rank=rank, step=None, why=f"rank {rank}'s note is unreadable"))
            continue
        if note.step is not None and not _file_matches(folder / f"rank{rank}.safetensors", note, fingerprint):
            note = Note(rank=rank, step=None, why=f"rank {rank}'s file does not match its note")
        notes.append(note)
    return notes


def _parse(raw: Any, rank: int) -> Note:
    step, keep, out = raw["step"], raw.get("keep_before"), raw.get("unaudited_since")
    for value in (step, keep, out):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"not a step: {value!r}")
    if raw["rank"] != rank:
        raise ValueError(f"rank {raw['rank']!r} in rank {rank}'s note")
    return Note(rank=rank, step=step, why=str(raw.get("why", "")), keep_before=keep, unaudited_since=out)


def _file_matches(path: Path, note: Note, fingerprint: str) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, ValueError, RuntimeError):
        return False
    return (meta.get("step"), meta.get("rank"), meta.get("fingerprint")) == (str(note.step), str(note.rank),
                                                                           fingerprint)


def settle(root: str | Path, plan: Plan, *, last_step: int, key: bytes, audit_every: int | None = None,
           verify: bool = True) -> Decision:
    """After a failure of a run on ``plan`` (whose last step is ``last_step``; ``audit_every`` and ``verify``: the
    run's ``--audit-every`` and verification, which decide its auditors and lookback): mark the survivor
    checkpoint complete when :func:`decide` accepts it, else discard it; the survivors' folder is gone
    afterwards."""
    fingerprint = plan.model.fingerprint
    notes = read_notes(root, num_ranks=plan.num_ranks, fingerprint=fingerprint)
    done = checkpoint.complete_steps(root)
    decision = decide(notes, stage_of={r.rank: r.stage for r in plan.ranks}, num_stages=plan.num_stages,
                      newest=done[-1] if done else None, last_step=last_step,
                      auditors=retention.plan_auditors(plan, audit_every=audit_every, verify=verify))
    if decision.step is not None:
        target = checkpoint.step_folder(root, decision.step)
        target.mkdir(parents=True, exist_ok=True)
        for rank in decision.ranks:  # a rank file left there by the step's unfinished checkpoint holds the same
            os.replace(Path(root) / FOLDER / f"rank{rank}.safetensors", target / f"rank{rank}.safetensors")
        checkpoint.complete(root, step=decision.step, layout=checkpoint.Layout.of(plan), key=key,
                            ranks=decision.ranks, **_retention(plan, notes, audit_every, verify))
    clear(root)
    return decision


def _retention(plan: Plan, notes: Sequence[Note], audit_every: int | None, verify: bool) -> dict[str, Any]:
    """What the survivor checkpoint's pruning keeps: the run's audit lookback and the earliest first flagged step
    a note names, as if every audited sender and some unaudited one were flagged there (a note names no sender;
    a lying one only keeps more)."""
    verifying = bool(verify and plan.policy.enabled and plan.verifiers)
    lookback = retention.plan_lookback(plan, audit_every=audit_every, verifying=verifying)
    flags = [n.keep_before for n in notes if n.keep_before is not None]
    if not flags:
        return {"lookback": lookback, "unresolved": {}}
    return {"lookback": lookback, "unresolved": {s: min(flags) for s in (-1, *lookback.back)}}


def clear(root: str | Path) -> None:
    """Remove what survivors left (before a run starts, and once settled)."""
    shutil.rmtree(Path(root) / FOLDER, ignore_errors=True)
