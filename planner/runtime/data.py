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
* ``text:FILE``: the user's text file encoded by the model's own tokenizer when
  its ``hf:`` model folder holds one (read offline), else its bytes, for
  language models with a vocabulary of at least 256 (byte-level, as the presets are);
* ``tokens:FILE``: the user's token ids, a flat ``.npy`` array or a nanoGPT-style
  ``.bin`` (raw uint16), every id checked against the model's vocabulary;
* ``package.module:factory``: the hook for the Python API. ``factory(bundle,
  seed)`` returns an object with ``batch(step, size) -> (inputs tuple,
  targets)``. A spec string rather than a callable, because each rank is its
  own process and must import it.

``text:``, ``tokens:`` and ``hf:`` are reserved prefixes, never module names:
``text:foo`` is a file called ``foo``, not the factory ``foo`` of a module
``text``. The file sources draw random windows per step like ``text`` does.

``resolve_loss(spec)`` does the same for the loss: default the model's own
(``models.registry.loss_fn``), or ``package.module:function(logits, targets)``
returning the mean loss of a microbatch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from models import hf_tokens
from models.data import (
    ByteTextDataset,
    TokenWindows,
    check_token_ids,
    load_text_bytes,
    load_token_file,
    synthetic_batch,
)
from models.registry import ModelBundle, build_model, loss_fn
from planner.errors import InvalidInputError
from planner.plan import Plan

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DATA_KINDS = ("auto", "text", "synthetic")
FILE_PREFIXES = ("text", "tokens")
RESERVED_PREFIXES = (*FILE_PREFIXES, "hf")  # spec prefixes that are never imported as modules
DATA_SPEC_FORMS = "auto, text, synthetic, text:FILE, tokens:FILE (.npy or .bin) or package.module:factory"


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    """A parsed ``--data`` value: a built-in ``kind`` (auto, text, synthetic), a file (``text-file`` or
    ``tokens-file``, ``target`` its path) or a ``factory`` (``target`` the ``package.module:factory`` spec)."""

    kind: str
    target: str = ""


def parse_data_spec(spec: str) -> DataSpec:
    """The one reading of a ``--data`` value: built-in kinds, then reserved prefixes, then factories."""
    if spec in DATA_KINDS:
        return DataSpec(kind=spec)
    prefix, sep, rest = spec.partition(":")
    if not sep:
        raise InvalidInputError(f"data source {spec!r}", expected=f"one of {DATA_SPEC_FORMS}")
    if prefix in FILE_PREFIXES:
        if not rest:
            raise InvalidInputError(f"--data {spec!r}", expected=f"{prefix}:FILE", found="no file name")
        return DataSpec(kind=f"{prefix}-file", target=rest)
    if prefix == "hf":
        raise InvalidInputError(f"--data {spec!r}", expected=f"one of {DATA_SPEC_FORMS}",
                                found="a Hugging Face data set (runs read no hub)",
                                fix="save its token ids as a flat .npy array and pass --data tokens:FILE.npy")
    return DataSpec(kind="factory", target=spec)


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
class FileSource:
    """Windows of the user's text bytes or token ids (``models.data.TokenWindows``)."""

    windows: TokenWindows
    seed: int = 0

    def batch(self, step: int, size: int) -> Batch:
        idx, targets = self.windows.batch(step, size, self.seed)
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
    spec = parse_data_spec(kind)
    if spec.kind == "factory":
        source = _import(spec.target, "data factory")(bundle, seed)
        if not callable(getattr(source, "batch", None)):
            raise InvalidInputError(f"data factory {kind!r} result", expected="an object with batch(step, size)",
                                    found=type(source).__name__)
        return source
    seq_len = (seq or int(bundle.example_inputs[0].shape[1])) if _takes_tokens(bundle) else 0
    if spec.kind in ("text-file", "tokens-file"):
        return FileSource(windows=_file_windows(bundle, spec, seq_len), seed=seed)
    is_text_lm = _takes_tokens(bundle) and bundle.vocab_or_classes >= 256
    if spec.kind == "text" and not is_text_lm:
        raise InvalidInputError(f"--data text for {bundle.name}", expected="a language model with vocab >= 256",
                                found=f"{bundle.family} with {bundle.vocab_or_classes} outputs",
                                fix="use --data synthetic")
    if spec.kind == "text" or (spec.kind == "auto" and is_text_lm):
        return TextSource(seq_len=seq_len, seed=seed)
    return SyntheticSource(bundle=bundle, seed=seed)


def check_data_file(kind: str) -> None:
    """What needs no model: the spec, and a data file's existence, size and format (the command line checks
    this first, before the model is built; :func:`check_data` then checks the file against the model)."""
    spec = parse_data_spec(kind)
    if spec.kind == "text-file":
        load_text_bytes(spec.target)
    elif spec.kind == "tokens-file":
        load_token_file(spec.target)


def check_data(bundle: "ModelBundle", *, kind: str, seq: int | None = None) -> None:
    """What the launcher checks before any rank starts: the spec, and a data file against the model
    (a factory is imported by the ranks only, where its code is meant to run)."""
    if parse_data_spec(kind).kind != "factory":
        make_source(bundle, kind=kind, seq=seq)


def _takes_tokens(bundle: "ModelBundle") -> bool:
    """A language model whose one input is token ids ``[B, T]``."""
    inputs = bundle.example_inputs
    return (bundle.family == "lm" and len(inputs) == 1 and inputs[0].dim() == 2
            and not inputs[0].dtype.is_floating_point)


def _file_windows(bundle: "ModelBundle", spec: DataSpec, seq_len: int) -> TokenWindows:
    name, vocab = f"{spec.kind.removesuffix('-file')}:{spec.target}", bundle.vocab_or_classes
    if not _takes_tokens(bundle):
        raise InvalidInputError(f"--data {name} for {bundle.name}", expected="a language model taking token ids "
                                "[batch, seq]", found=f"{bundle.family} with {len(bundle.example_inputs)} input(s)",
                                fix="use --data synthetic or a package.module:factory")
    folder = hf_tokens.tokenizer_folder(bundle.spec)
    if spec.kind == "text-file" and folder is not None:  # the model's own tokenizer, saved beside its config
        load_text_bytes(spec.target)  # the file's checks (exists, not empty, a file)
        text = Path(spec.target).read_text(encoding="utf-8", errors="replace")
        ids = np.asarray(hf_tokens.tokenize(folder, text), dtype=np.int64)
        if ids.size and int(ids.max()) >= vocab:
            raise InvalidInputError(f"--data {name} tokenised by {str(folder)!r}", expected=f"token ids below the "
                                    f"model's vocabulary {vocab}", found=f"up to {int(ids.max())}",
                                    fix="save the tokenizer that belongs to this config in the model folder")
        return TokenWindows(ids, seq_len, name=name)
    if spec.kind == "text-file":
        if vocab < 256:  # byte-level: every byte value must be a token
            raise InvalidInputError(f"--data {name} for {bundle.name}", expected="a vocabulary of at least 256 "
                                    "tokens (text is read as bytes)", found=f"vocab {vocab}",
                                    fix="tokenise the text yourself and pass --data tokens:FILE.npy")
        return TokenWindows(load_text_bytes(spec.target), seq_len, name=name)
    windows = TokenWindows(load_token_file(spec.target), seq_len, name=name)
    check_token_ids(spec.target, vocab)
    return windows


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


class PassBatches:
    """A step's batches under gradient accumulation: pass ``k`` of optimizer step ``s`` trains on the data
    of pipeline pass ``s * accumulate + k`` (set ``pass_index`` before each pass), so every pass of a run
    sees its own batch and a resumed run the same ones."""

    def __init__(self, batches: PlanBatches, accumulate: int) -> None:
        self.batches, self.accumulate, self.pass_index = batches, accumulate, 0

    def microbatch(self, step: int, mb: int) -> Batch:
        return self.batches.microbatch(step * self.accumulate + self.pass_index, mb)


# The validation batch's index: beyond any run's steps, so its draws differ from every training step's.
EVAL_STEP = 10**12


def eval_batches(plan: "Plan", *, kind: str, seed: int = 0, device: torch.device | str = "cpu") -> PlanBatches:
    """The fixed validation batch of ``plan`` from the ``--eval-data`` spec ``kind``: batch ``EVAL_STEP`` of
    its source, cut into the plan's microbatches, the same at every validation pass. The built-in byte text
    (``text``, or ``auto`` for a byte-level LM) reads its held-out files (``ByteTextDataset``'s val split)."""
    mbs = plan.config.microbatch_size
    bundle = build_model(plan.model.spec, batch=mbs, seq=plan.model.seq, device="meta", seed=seed)
    source = make_source(bundle, kind=kind, seq=plan.model.seq, seed=seed)
    if isinstance(source, TextSource):
        source = TextSource(seq_len=source.seq_len, seed=seed, dataset=ByteTextDataset(source.seq_len, "val"))
    return PlanBatches(source, global_batch=plan.config.global_batch, microbatch_size=mbs, device=device)


def plan_example_inputs(plan: "Plan", *, data: str = "auto", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One real microbatch of inputs for ``plan``'s model (what ``apply_plan`` exports at)."""
    bundle = build_model(plan.model.spec, batch=plan.model.batch, seq=plan.model.seq, device="meta")
    source = make_source(bundle, kind=data, seq=plan.model.seq, seed=seed)
    inputs, _ = source.batch(0, plan.config.microbatch_size)
    return inputs
