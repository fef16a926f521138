"""Training batches for a plan, identical on every rank without communication.

Each step's global batch is a pure function of ``(step, seed)``; microbatch
``m`` is rows ``[m * microbatch_size, (m + 1) * microbatch_size)`` of it (the
plan's convention). The first stage takes the inputs, the last stage the
targets, and neither needs to send them.

Sources:

* ``text``: byte-level text (``models.data.ByteTextDataset``, the Python
  standard library's sources) for language models with a vocabulary of at
  least 256 tokens;
* ``synthetic``: ``models.data.synthetic_batch`` (a learnable teacher rule)
  for everything else;
* ``package.module:factory``: the hook for the Python API. ``factory(bundle,
  seed)`` returns an object with ``batch(step, size) -> (inputs tuple,
  targets)``. A spec string rather than a callable, because each rank is its
  own process and must import it.

``resolve_loss(spec)`` does the same for the loss: default the model's own
(``models.registry.loss_fn``), or ``package.module:function(logits, targets)``
returning the mean loss of a microbatch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from models.data import ByteTextDataset, synthetic_batch
from models.registry import ModelBundle, build_model, loss_fn
from planner.errors import InvalidInputError
from planner.plan import Plan

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DATA_KINDS = ("auto", "text", "synthetic")


class DataSource(Protocol):
    def batch(self, step: int, size: int) -> Batch: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TextSource:
    """Byte-level text windows; targets are the inputs shifted by one byte."""

    seq_len: int
    seed: int = 0
    dataset: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dataset is None:
            object.__setattr__(self, "dataset", ByteTextDataset(self.seq_len))

    def batch(self, step: int, size: int) -> Batch:
        idx, targets = self.dataset.batch(step, size, self.seed)  # type: ignore[attr-defined]
        return (idx,), targets


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticSource:
    """Synthetic inputs shaped like the model's example inputs, labelled by a fixed teacher."""

    bundle: "ModelBundle"
    seed: int = 0

    def batch(self, step: int, size: int) -> Batch:
        return synthetic_batch(self.bundle, step, size, self.seed)


def _import(spec: str, what: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidInputError(f"{what} {spec!r}", expected="package.module:function")
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"cannot import {module_name!r} for {what} {spec!r}", found=str(exc),
                                fix="check the module path and PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise InvalidInputError(f"{module_name!r} has no attribute {attr!r} ({what})")
        target = getattr(target, part)
    if not callable(target):
        raise InvalidInputError(f"{what} {spec!r}", expected="a callable", found=type(target).__name__)
    return target


def make_source(bundle: "ModelBundle", *, kind: str = "auto", seq: int | None = None, seed: int = 0) -> DataSource:
    """The data source for ``bundle``: ``auto`` = byte text for byte-vocabulary LMs, else synthetic."""
    if ":" in kind:
        source = _import(kind, "data factory")(bundle, seed)
        if not callable(getattr(source, "batch", None)):
            raise InvalidInputError(f"data factory {kind!r} result", expected="an object with batch(step, size)",
                                    found=type(source).__name__)
        return source
    if kind not in DATA_KINDS:
        raise InvalidInputError(f"data source {kind!r}", expected=f"one of {', '.join(DATA_KINDS)} or "
                                "package.module:factory")
    is_text_lm = bundle.family == "lm" and bundle.vocab_or_classes >= 256 and len(bundle.example_inputs) == 1
    if kind == "text" and not is_text_lm:
        raise InvalidInputError(f"--data text for {bundle.name}", expected="a language model with vocab >= 256",
                                found=f"{bundle.family} with {bundle.vocab_or_classes} outputs",
                                fix="use --data synthetic")
    if kind == "text" or (kind == "auto" and is_text_lm):
        return TextSource(seq_len=seq or int(bundle.example_inputs[0].shape[1]), seed=seed)
    return SyntheticSource(bundle=bundle, seed=seed)


def resolve_loss(bundle: "ModelBundle", spec: str | None = None) -> LossFn:
    if spec:
        return _import(spec, "loss function")
    return loss_fn(bundle)


class PlanBatches:
    """Microbatches of a plan's steps from a source; the current step's global batch is cached."""

    def __init__(self, source: DataSource, *, global_batch: int, microbatch_size: int,
                 device: torch.device | str = "cpu") -> None:
        self.source = source
        self.global_batch = global_batch
        self.microbatch_size = microbatch_size
        self.device = torch.device(device)
        self._step: int | None = None
        self._batch: Batch | None = None

    def global_step_batch(self, step: int) -> Batch:
        if self._step != step:
            inputs, targets = self.source.batch(step, self.global_batch)
            for t in (*inputs, targets):
                if t.shape[0] != self.global_batch:
                    raise InvalidInputError(f"data batch of step {step}", expected=f"{self.global_batch} rows",
                                            found=str(tuple(t.shape)))
            self._batch = (tuple(t.to(self.device) for t in inputs), targets.to(self.device))
            self._step = step
        assert self._batch is not None
        return self._batch

    def microbatch(self, step: int, mb: int) -> Batch:
        inputs, targets = self.global_step_batch(step)
        lo = mb * self.microbatch_size
        hi = lo + self.microbatch_size
        return tuple(t[lo:hi] for t in inputs), targets[lo:hi]


def plan_example_inputs(plan: "Plan", *, data: str = "auto", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One real microbatch of inputs for ``plan``'s model (what ``apply_plan`` exports at)."""
    bundle = build_model(plan.model.spec, batch=plan.model.batch, seq=plan.model.seq, device="meta")
    source = make_source(bundle, kind=data, seq=plan.model.seq, seed=seed)
    inputs, _ = source.batch(0, plan.config.microbatch_size)
    return inputs
