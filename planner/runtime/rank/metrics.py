"""Per-step, per-rank metrics: what each rank spent its step on, as JSON lines.

Every rank measures its own step (wall clock from the end of its previous step
to the end of this one, so ``step_ms`` is the steady-state period; ``cpu_ms`` is
the CPU time the process used in that period, which a shared machine's load
does not inflate) and splits
it into compute (forward/backward), emulation padding, waiting (blocked on a
receive or a verdict), communication (posting sends, all-reduce, gathering
flags), verification (scoring) and the optimizer. ``compute_cpu_ms`` is the CPU
time of the passes on the thread that ran them (with one torch thread on CPU,
all of their work; 0 where that does not hold): beside ``compute_ms`` it shows
how much of the compute's wall time the rank spent descheduled. Likewise
``thread_cpu_ms`` (the executing thread's CPU time over the step) and the
``*_cpu_ms`` of waits, posting, verification and the optimizer: ``own_cpu_ms``,
what is left, is the executor's own CPU time (``planner.profiling.probes``'s
executor probe prices it per message). The numbers travel to rank 0
as one small float64 tensor per step (a point-to-point send, so collecting
them never synchronises the pipeline), and rank 0 writes one JSON line per
rank and step.

Beside each rank's own figures a row carries the step's figures (the same on every row of the step,
never read back into :class:`StepMetrics`): ``loss``, the mean training loss of the step over all ranks,
and ``eval_loss``, the validation loss after the step where one was measured (``--eval-every``).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

import torch

from planner.errors import InvalidInputError


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """One rank's step. On a last-stage rank ``loss_sum``/``loss_count`` are the summed mean losses and
    the number of its microbatches that were kept (not dropped by verification), and ``eval_loss_*`` the
    same of the validation pass after the step (0 where none ran); 0 elsewhere. ``lr``: the learning rate
    this rank's optimizer stepped with (0 without one). ``sent_act_bytes``/``sent_grad_bytes``: the bytes of
    the boundary payloads this rank sent (its stage's output, its input's gradient; verifier copies
    included, headers not), as its boundary codecs encode them (``planner.runtime.wire.codecs``)."""

    step: int
    rank: int
    step_ms: float
    cpu_ms: float = 0.0
    compute_ms: float = 0.0
    compute_cpu_ms: float = 0.0
    pad_ms: float = 0.0
    wait_ms: float = 0.0
    comm_ms: float = 0.0
    verify_ms: float = 0.0
    optim_ms: float = 0.0
    loss_sum: float = 0.0
    loss_count: int = 0
    dropped: int = 0
    flagged: int = 0
    banned: int = 0
    # The CPU time of the thread that runs the program (the executor's): over the whole step period, and
    # within the waits, the posting of messages, verification and the optimizer (see ``own_cpu_ms``).
    thread_cpu_ms: float = 0.0
    wait_cpu_ms: float = 0.0
    comm_cpu_ms: float = 0.0
    verify_cpu_ms: float = 0.0
    optim_cpu_ms: float = 0.0
    eval_loss_sum: float = 0.0
    eval_loss_count: int = 0
    lr: float = 0.0
    sent_act_bytes: int = 0
    sent_grad_bytes: int = 0

    def __post_init__(self) -> None:
        if self.step < 0 or self.rank < 0 or self.step_ms < 0:
            raise InvalidInputError("step metrics", expected="step, rank and step_ms >= 0",
                                    found=f"{self.step}, {self.rank}, {self.step_ms}")

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([float(getattr(self, f.name)) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepMetrics":
        values = t.tolist()
        kwargs = {}
        for f, v in zip(fields(cls), values):
            kwargs[f.name] = int(v) if f.type in ("int", int) else float(v)
        return cls(**kwargs)

    @classmethod
    def numel(cls) -> int:
        return len(fields(cls))

    def to_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @property
    def busy_ms(self) -> float:
        return self.compute_ms + self.pad_ms

    @property
    def own_cpu_ms(self) -> float:
        """The executor thread's CPU time outside passes, waits, verification and the optimizer: its own
        bookkeeping per instruction, posting messages included (meaningful where ``compute_cpu_ms`` is)."""
        return max(self.thread_cpu_ms - self.compute_cpu_ms - self.wait_cpu_ms - self.verify_cpu_ms
                   - self.optim_cpu_ms, 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSummary:
    """All ranks' view of one step: the mean loss over the kept microbatches (NaN if none was kept),
    the slowest rank's period, the CPU time of all ranks, and the most microbatches any rank dropped;
    the validation loss after the step (None where none ran) and rank 0's learning rate."""

    step: int
    loss: float
    step_ms: float
    cpu_ms: float  # summed over the ranks
    dropped: int
    ranks: tuple[StepMetrics, ...]
    eval_loss: float | None = None
    lr: float = 0.0


def summarize_step(rows: Sequence[StepMetrics]) -> StepSummary:
    count = sum(r.loss_count for r in rows)
    eval_count = sum(r.eval_loss_count for r in rows)
    return StepSummary(step=rows[0].step, loss=sum(r.loss_sum for r in rows) / count if count else math.nan,
                       step_ms=max(r.step_ms for r in rows), cpu_ms=sum(r.cpu_ms for r in rows),
                       dropped=max((r.dropped for r in rows), default=0), ranks=tuple(rows),
                       eval_loss=sum(r.eval_loss_sum for r in rows) / eval_count if eval_count else None,
                       lr=rows[0].lr)


def measured_step_ms(steps: Sequence[StepSummary], *, warmup: int = 1) -> float:
    """Median step period after ``warmup`` steps (all steps if there are no more)."""
    if not steps:
        raise InvalidInputError("measured step time", expected="at least one step", found="none")
    kept = steps[warmup:] if len(steps) > warmup else steps
    return float(statistics.median(s.step_ms for s in kept))


class MetricsWriter:
    """Writes JSON lines to a file (or nothing, with no path); a non-finite figure (a diverged loss) is
    written as null, valid JSON. Nothing is ever truncated: a resumed run (``append``) adds to the rows
    of the steps before it; a fresh run over a file with rows first moves that file to ``NAME.N`` (the
    first free N), so each file holds one run. The file is opened at the first step's rows, so a run
    that fails before any step completes leaves everything as it was."""

    def __init__(self, path: str | os.PathLike | None, *, append: bool = False) -> None:
        self.path = Path(path) if path else None
        self.append = append
        self.moved_to: Path | None = None  # where an earlier run's file went
        self._fh: IO[str] | None = None

    def write(self, rows: Iterable[StepMetrics]) -> None:
        if self.path is None:
            return
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.append and self.path.is_file() and self.path.stat().st_size > 0:
                self.moved_to = _free_name(self.path)
                self.path.rename(self.moved_to)
            self._fh = self.path.open("a", encoding="utf-8")
        rows = list(rows)
        steps = {s: _step_columns(summarize_step([r for r in rows if r.step == s])) for s in {r.step for r in rows}}
        for row in rows:
            self._fh.write(json.dumps(_finite({**row.to_json(), **steps[row.step]}), allow_nan=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


STEP_COLUMNS = ("loss", "eval_loss")  # the step's figures on each of its rows (not StepMetrics fields)


def _step_columns(s: StepSummary) -> dict[str, float]:
    """The step's mean training loss, and its validation loss where one was measured."""
    out = {"loss": round(s.loss, 6) if math.isfinite(s.loss) else s.loss}
    if s.eval_loss is not None:
        out["eval_loss"] = round(s.eval_loss, 6) if math.isfinite(s.eval_loss) else s.eval_loss
    return out


def _free_name(path: Path) -> Path:
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


def read_metrics(path: str | os.PathLike) -> list[StepMetrics]:
    """Read a metrics JSON-lines file back."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                rows.append(StepMetrics(**{k: math.nan if v is None else v for k, v in row.items()
                                           if k not in STEP_COLUMNS}))
    return rows


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
