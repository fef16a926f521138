"""SENTINEL-style integrity monitors for the tensors that cross stage boundaries.

A verifier rank receives a copy of every checked boundary tensor (activations
forward, gradients backward) and decides, without recomputing anything,
whether the sender corrupted it:

1. Per (boundary, direction) a :class:`Monitor` keeps an exponential moving
   average of the tensors' distribution summary (``summaries.Summary``;
   activations beta 0.9, gradients 0.8), a history of sketches of recent
   tensors and two learnt predictors of the rows: a label table (with the
   microbatch's token ids) and a linear surrogate of the sending stage (from
   the stage's input, when this verifier also checks the boundary before it).
2. Each microbatch is scored against them with scale-free distances: mean
   absolute difference and normalised L2 of the per-feature moments, size
   change, sign-flip ratio, skew flip, sliced Wasserstein, spectral residual,
   label binding, stage link and the shape of its residual, replay (see
   ``distances``), and a CUSUM of each sender's step-level residual scores
   ("drift": the one test of a sequence, for an attacker who keeps every
   single sample just inside its fence).
3. Each distance has an IQR fence over a rolling window of accepted scores
   (``thresholds``); a sample is flagged when two distances are above their
   fences, or one far above it, unless the stage's surrogate explains it
   (``evidence``); one a little above is left to its step's average. With the
   stage's input at hand, ``scale`` is the size change the stage added to its
   input's. Within a step every sample is scored against the reference of the
   step's start; the samples that pass are folded in when the step closes, after each
   sender's step *as a whole* passed the same tests with its own fences (the
   per-sample ones until those have ``min_samples`` steps; the
   average of four microbatches is half as noisy: that is what catches subtle
   attacks). Flagged and tainted samples never update the averages, the
   windows, the history or the predictors.
4. At the end of a step all verifiers' flags are gathered; per microbatch only
   the most upstream flagged sender is blamed (a corruption upstream makes
   everything downstream look odd). A flagged microbatch is dropped at once;
   a ban needs accumulated evidence: a sequential test per sender on how often
   it is blamed (``bans``), with a stated bound on honest senders' false bans.

Why summaries rather than raw tensors: consecutive microbatches hold different
data, so an elementwise average of them is a blur that every honest tensor is
far from. The statistics above are what stays stable from batch to batch.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.errors import InvalidInputError
from planner.integrity import distances as dist
from planner.integrity import predictors as pred
from planner.integrity import summaries as summ
from planner.integrity.audit import AuditLedger, is_audit
from planner.integrity.bans import BanTest
from planner.integrity.blame import (
    STEP_MB,
    blame_weights,
    culprit,
    flatten_events,
    input_key,
    is_alert,
    needed,
    proven,
    replayed,
)
from planner.integrity.monitor import Monitor
from planner.verifier_config import DIRECTIONS, VerifierConfig

__all__ = ["Verdict", "Verifier"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What a check decided about one received microbatch tensor.

    ``flagged``: this sample is judged corrupted (blame its sender).
    ``tainted``: the consumer must not use it (flagged, or it arrived tainted
    because its input was already dropped upstream). ``scores``: distance ->
    score; ``reasons``: the distances that exceeded their fence.
    """

    flagged: bool
    tainted: bool
    scores: dict[str, float] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()



class Verifier:
    """The monitors of the boundaries one verifier rank checks, plus blame and bans.

    ``config``: the plan's ``verifier_config`` (see :class:`VerifierConfig`).
    ``boundaries``: ``(boundary index, "act" | "grad")`` pairs this verifier checks. ``watched``: those
    of them whose sender is trusted, seen only as the next stage's link-test input: scored and learnt
    from, never flagged (a trusted sender is not to blame). ``stage_of`` (rank -> stage) and
    ``microbatches`` (rank -> microbatches a step): the plan's, for blame among twins and by rate.
    ``codecs``: boundary -> its wire codec (the plan stages' ``out_codec``; absent: ``none``), for the tests of
    a compressed boundary (``persistence.PERSIST_K``).
    """

    def __init__(self, config: Mapping[str, Any], boundaries: Sequence[tuple[int, str]],
                 watched: Sequence[tuple[int, str]] = (), *, stage_of: Mapping[int, int] | None = None,
                 microbatches: Mapping[int, int] | None = None, codecs: Mapping[int, str] | None = None) -> None:
        self.config = VerifierConfig.from_dict(config)
        # who is whose twin (rank -> stage) and each sender's microbatches a step: blame by rate, shared
        # among twins (``blame.blame_weights``); the plan's, the same on every verifier
        self.stage_of = {int(k): int(v) for k, v in (stage_of or {}).items()}
        self.microbatches = {int(k): int(v) for k, v in (microbatches or {}).items()}
        self._flag_since: dict[int, int] = {}   # sender -> first step of its current run of flags or alerts
        self._ban_first: dict[int, int] = {}    # banned sender -> its first flagged step (``_flag_since``)
        watch = {(int(b), d) for b, d in watched}  # each monitor keeps its own flag
        if not watch <= {(int(b), d) for b, d in boundaries}:
            raise InvalidInputError("verifier watched boundaries", expected=f"some of {sorted(boundaries)}",
                                    found=repr(sorted(watch)))
        self._monitors: dict[tuple[int, str], Monitor] = {}
        for boundary, direction in boundaries:
            if direction not in DIRECTIONS:
                raise InvalidInputError(f"verifier boundary {boundary} direction", expected="act or grad",
                                        found=repr(direction))
            self._monitors[(int(boundary), direction)] = Monitor(
                self.config, int(boundary), direction, watch_only=(int(boundary), direction) in watch,
                codec=str((codecs or {}).get(int(boundary), "none")))
        self.events: list[dict[str, Any]] = []
        self._step_flags: dict[int, list[dict[str, Any]]] = {}
        # Accepted rows, their size change, log size and sender, as the next stage's input for its link test.
        self._rows: dict[tuple[tuple[int, str], int, int], tuple[torch.Tensor, float | None, float, int | None]] = {}
        self._blamed_steps: dict[int, list[int]] = {}
        self._lone: dict[int, float] = {}     # sender -> its flagged microbatches of the last step, not blamed
        self.last_blamed: set[int] = set()    # the senders the last ``end_step`` blamed
        self._bans = BanTest(honest_rate=self.config.ban_honest_rate, attack_rate=self.config.ban_attack_rate,
                             false_steps=self.config.ban_false_steps, replay_rate=self.config.ban_replay_rate)
        self.banned: set[int] = self._bans.banned
        self.audit_ledger = AuditLedger()
        self._audits: dict[str, dict[int, int]] = {"run": {}, "failed": {}}   # per sender
        self._audits_suspended: dict[int, int] = {}   # stage -> step its replicas' reported updates disagreed
        self._signed = {"forged": 0, "voided": 0}   # audits from signed inputs: forgeries caught, complaints
        # (step, boundary, direction) -> the (sender, mb) whose tensor there passed an audit: no flag of it stands
        self._passed: dict[tuple[int, int, str], set[tuple[int, int]]] = {}
        self._refuted = 0   # microbatch flags a passed audit of the same tensor withdrew

    def record_audit(self, sender: int, step: int, *, passed: bool, mb: int | None = None,
                     boundary: int | None = None, direction: str | None = None) -> None:
        """One audit of ``sender``'s microbatch (``audit``), for the summary and the ledger of vouched steps.
        Given the audited tensor (``mb``, ``boundary``, ``direction``) and recorded before the step's flags are
        taken (:meth:`flag_events`), a pass withdraws this verifier's flags of that tensor: an audit outranks the
        statistics (a flag costs an audit, never a ban by itself; see ``culprits.vouched``)."""
        self.audit_ledger.record(sender, step, passed=passed)
        if passed and mb is not None and boundary is not None and direction is not None:
            self._passed.setdefault((int(step), int(boundary), direction), set()).add((int(sender), int(mb)))
        for key in ("run",) if passed else ("run", "failed"):
            self._audits[key][sender] = self._audits[key].get(sender, 0) + 1

    def record_signed(self, *, forged: int, voided: int) -> None:
        """A step's forwarded inputs that their signature did not cover (each also a failed audit) and audits a
        replica's complaint voided (``runtime.rank.audit_signed``)."""
        self._signed["forged"] += forged
        self._signed["voided"] += voided

    def suspend_audits(self, stage: int, step: int, *, why: str = "its replicas reported different updates") -> None:
        """``stage``'s audits stopped at ``step``, for ``why`` (by default: someone lied about its update)."""
        self._audits_suspended.setdefault(stage, step)
        self.events.append({"type": "audits_suspended", "step": int(step), "stage": int(stage), "why": why})

    def monitor(self, boundary: int, direction: str) -> Monitor:
        key = (boundary, direction)
        if key not in self._monitors:
            raise InvalidInputError(f"verifier check of boundary {boundary} ({direction})",
                                    expected=f"one of {sorted(self._monitors)}", found=repr(key),
                                    fix="the plan's VERIFY instructions and verifier boundaries disagree")
        return self._monitors[key]

    def check(self, boundary: int, direction: str, tensor: torch.Tensor, *, step: int, mb: int,
              sender: int, tainted: bool = False, labels: torch.Tensor | None = None) -> Verdict:
        """Score one received tensor; flagged samples are recorded for :meth:`end_step`.

        ``labels``: optional integer ids, one per row of ``tensor`` (the
        microbatch's input token ids for activations, its target ids for
        gradients); they enable the ``binding`` test where the ``link`` test
        cannot run. The ``link`` test needs no help: it runs whenever this
        verifier also checks the sending stage's input boundary (the boundary
        before it for activations, after it for gradients) and saw that
        microbatch there; it sees everything binding sees (rows of another
        batch) and more, so binding is skipped there (it would cost a sixth of
        a check for nothing).
        """
        mon = self.monitor(boundary, direction)
        data_key = None if labels is None else pred.ids_fingerprint(labels)   # which data: see ``history.CopyMemory``
        if input_key(boundary, direction) in self._monitors:
            labels = None
        mon.checked += 1
        if mon.first_step is None:
            mon.first_step = step
        if mon.step != step:
            self._close(mon)  # the executor skipped flag_events for the previous step
            mon.step = step
        # One subset of a large tensor's rows per microbatch, shared by all its boundaries
        # (a stage's input and output rows must stay aligned for its link test).
        summarized = mon.summarize(tensor, subset_seed=summ.stable_mix(self.config.seed, step, mb))
        if summarized is None:
            return Verdict(flagged=False, tainted=tainted, scores={}) if mon.watch_only else \
                self._flag(mon, step, mb, sender, {}, ("shape",))
        summary, rows, subset = summarized
        if labels is not None and subset is not None and labels.numel() == tensor.numel() // summ.feature_size(tensor):
            labels = labels.reshape(-1)[subset]   # one label per row: keep those of the subset
        # Any inf or NaN element makes its feature's std NaN (inf - inf, or NaN, around the
        # mean): one cheap test.
        if not math.isfinite(float(summary.std.sum())):
            return Verdict(flagged=False, tainted=tainted, scores={}) if mon.watch_only else \
                self._flag(mon, step, mb, sender, {}, ("nonfinite",))
        fits = mon.fits(rows, labels, self._rows.get((input_key(boundary, direction), step, mb)),
                        log_size=dist.log_size(summary))
        scores = mon.score(summary, (fits,), data_key=data_key)
        if tainted:
            # Its input was already dropped upstream: whatever it looks like, the
            # sender is not to blame, and it must not teach the reference.
            mon.tainted += 1
            self.events.append(self._event("tainted", mon, step, mb, sender, scores, ()))
            return Verdict(flagged=False, tainted=True, scores=scores)
        reasons = mon.exceeded(scores, step)
        if reasons:
            return self._flag(mon, step, mb, sender, scores, reasons, upstream=mon.culprit(sender, [fits], reasons))
        mon.hold(sender, summary, scores, fits, data_key, mb=mb)
        if input_key(boundary, direction, forward=False) in self._monitors:
            self._rows[((boundary, direction), step, mb)] = (rows, mon.size_change(summary), dist.log_size(summary),
                                                             None if mon.watch_only else sender)
        return Verdict(flagged=False, tainted=False, scores=scores)

    def _flag(self, mon: Monitor, step: int, mb: int, sender: int, scores: dict[str, float],
              reasons: tuple[str, ...], *, upstream: int | None = None) -> Verdict:
        mon.flagged += 1
        event = self._event("flag", mon, step, mb, sender, scores, reasons, upstream=upstream)
        self.events.append(event)
        self._step_flags.setdefault(step, []).append(event)
        return Verdict(flagged=True, tainted=True, scores=scores, reasons=reasons)

    def _close(self, mon: Monitor) -> None:
        step = mon.step
        audited = self._passed.get((step, mon.boundary, mon.direction), set()) if step is not None else set()
        for sender, scores, reasons, upstream in mon.close(audited):
            event = self._event("flag", mon, step, STEP_MB, sender, scores, reasons, per_sample=False,
                                upstream=upstream)
            self.events.append(event)
            self._step_flags.setdefault(step, []).append(event)

    @staticmethod
    def _event(kind: str, mon: Monitor, step: int, mb: int, sender: int, scores: Mapping[str, float],
               reasons: tuple[str, ...], *, per_sample: bool = True, upstream: int | None = None) -> dict[str, Any]:
        fences = mon.fence_values(per_sample=per_sample)
        event = {"type": kind, "step": int(step), "mb": int(mb), "boundary": mon.boundary,
                 "direction": mon.direction, "sender": int(sender),
                 "scope": "microbatch" if per_sample else "step",
                 "scores": {k: round(float(v), 6) for k, v in scores.items()},
                 "fences": {k: (None if v is None else round(v, 6)) for k, v in fences.items()},
                 "reasons": list(reasons)}
        if upstream is not None:
            event["upstream"] = int(upstream)
        return event

    def flag_events(self, step: int) -> list[dict[str, Any]]:
        """This verifier's flags of ``step`` as plain dicts (exchanged as JSON: ``FLAG_EVENTS_SCHEMA``).

        Call it once every microbatch of the step was checked: it closes the
        step (the step-level tests run here).
        """
        for mon in self._monitors.values():
            if mon.step == step:
                self._close(mon)
        for key in [k for k in self._rows if k[1] <= step]:
            del self._rows[key]
        flags = self._step_flags.get(step, [])
        kept = [e for e in flags if not self._refutes(e)]
        self._refuted += len(flags) - len(kept)
        if flags:
            self._step_flags[step] = kept
        for key in [k for k in self._passed if k[0] <= step]:
            del self._passed[key]
        return [dict(e) for e in kept]

    def _refutes(self, event: Mapping[str, Any]) -> bool:
        """Whether a passed audit of the very tensor a monitor's microbatch flag is about withdraws it (not one
        laid on the stage's input, ``upstream``, nor a contribution's or an audit's own flag)."""
        if int(event["mb"]) == STEP_MB or "upstream" in event or "stage" in event or is_audit(event):
            return False
        key = (int(event["step"]), int(event["boundary"]), str(event["direction"]))
        return (int(event["sender"]), int(event["mb"])) in self._passed.get(key, ())

    def add_flags(self, step: int, events: Iterable[Mapping[str, Any]]) -> None:
        """Flag events of ``step`` judged elsewhere on this rank (a replica's gradient contribution,
        ``contributions``), exchanged and blamed with the monitors' own."""
        for event in events:
            self.events.append(dict(event))
            self._step_flags.setdefault(step, []).append(dict(event))

    def end_step(self, step: int, all_flag_events: Iterable[Any]) -> set[int]:
        """Resolve blame for ``step`` from every verifier's flags; return all banned ranks.

        ``all_flag_events``: the flags of every verifier rank, flat or one list
        per rank (as the exchange returns them). Every verifier gets
        the same input, so every verifier reaches the same bans.
        """
        flags = [e for e in flatten_events(all_flag_events) if int(e["step"]) == step]
        weights = blame_weights(flags, stage_of=self.stage_of, microbatches=self.microbatches)
        blamed = {s for s, n in weights.items() if n + self._lone.get(s, 0.0) >= needed(s, self.microbatches)}
        self._lone = {s: n for s, n in weights.items() if s not in blamed}
        self.last_blamed = set(blamed)
        for sender in sorted(blamed):
            steps = self._blamed_steps.setdefault(sender, [])
            if step not in steps:
                steps.append(step)
        named = {culprit(e) for e in flags} | {int(e["sender"]) for e in flags}
        for sender in named:   # from where the evidence began: a contribution's alarm comes after its onset's update
            began = min((int(e["since"]) for e in flags if "since" in e and int(e["sender"]) == sender), default=step)
            self._flag_since[sender] = min(self._flag_since.get(sender, step), began, step)
        new = self._bans.step(blamed, replayed=replayed(flags), proven=proven(flags), at=step)
        for sender in [s for s in self._flag_since if s not in named and s not in self._bans.unresolved()]:
            del self._flag_since[sender]   # no flag this step and no evidence left: its run of flags ended
        for sender in new:
            self._ban_first[sender] = min(self._bans.bans[sender][0], self._flag_since.get(sender, step))
            self.events.append({"type": "ban", "step": int(step), "sender": sender,
                                "first_flagged_step": self._ban_first[sender],
                                "blamed_steps": list(self._blamed_steps.get(sender, [])[-20:]),
                                "evidence": round(self._bans.evidence.get(sender, 0.0), 3),
                                "replay_evidence": round(self._bans.replays.get(sender, 0.0), 3)})
        self._step_flags.pop(step, None)
        return set(self.banned)

    def unresolved(self) -> dict[int, int]:
        """Sender -> first flagged step of every sender whose flags are not resolved (``BanTest.unresolved``):
        the first step of its current run of flags or alerts, which may precede its first blamed step (a lone
        flagged microbatch, an alert), so recovery resumes from before anything of it was flagged."""
        return {s: min(first, self._flag_since.get(s, first), self._ban_first.get(s, first))
                for s, first in self._bans.unresolved().items()}

    def ban_records(self) -> dict[int, tuple[int, int]]:
        """Banned sender -> (its first flagged step, the step it was banned at)."""
        return {s: (min(first, self._ban_first.get(s, first)), ban) for s, (first, ban) in self._bans.bans.items()}

    def bans_state(self) -> dict[str, Any]:
        """The ban test's evidence and bans and the blame history, for a checkpoint."""
        return {**self._bans.to_json(), "blamed_steps": {str(k): v for k, v in self._blamed_steps.items()},
                "lone_flags": {str(k): v for k, v in self._lone.items()},
                "flag_since": {str(k): v for k, v in self._flag_since.items()},
                "ban_first": {str(k): v for k, v in self._ban_first.items()}}

    def restore_bans(self, data: Mapping[str, Any]) -> None:
        self._bans.restore(dict(data))
        self._blamed_steps = {int(k): [int(s) for s in v] for k, v in data.get("blamed_steps", {}).items()}
        self._lone = {int(k): float(v) for k, v in data.get("lone_flags", {}).items()}
        self._flag_since = {int(k): int(v) for k, v in data.get("flag_since", {}).items()}
        self._ban_first = {int(k): int(v) for k, v in data.get("ban_first", {}).items()}

    def summary(self) -> dict[str, Any]:
        """Counts, current fences and bans, for logs and the ``--report`` file."""
        monitors = [{"boundary": b, "direction": d, "checked": m.checked, "flagged": m.flagged,
                     "step_flags": m.step_flags, "tainted": m.tainted, "vouched": m.vouched,
                     "fences": m.fence_values(),
                     "step_fences": m.fence_values(per_sample=False)}
                    for (b, d), m in sorted(self._monitors.items())]
        return {"monitors": monitors, "banned": sorted(self.banned),
                "blamed_steps": {str(k): list(v) for k, v in sorted(self._blamed_steps.items())},
                "flags": sum(1 for e in self.events if e["type"] == "flag"),
                "alerts": sum(1 for e in self.events if e["type"] == "flag" and is_alert(e)),
                "audits": {"run": sum(self._audits["run"].values()), "failed": sum(self._audits["failed"].values()),
                           "run_by_sender": {str(k): v for k, v in sorted(self._audits["run"].items())},
                           "failed_by_sender": {str(k): v for k, v in sorted(self._audits["failed"].items())},
                           "suspended": {str(k): v for k, v in sorted(self._audits_suspended.items())},
                           "refuted_flags": self._refuted,
                           "signed": dict(self._signed)},
                "config": self.config.to_dict()}

