"""Hugging Face ``transformers`` models as Stagewise models, unchanged.

Two ways in, one adaptation:

* the spec ``hf:CONFIG[?key=value,...]``: ``CONFIG`` is a model type (``hf:llama``,
  ``hf:gpt2?n_layer=2,n_embd=64``) or the path of a ``config.json`` or of a model
  folder holding one (``hf:./my-model``, ``hf:path/config.json``). Overrides are
  config keys with JSON scalar values (strings otherwise); the reserved key
  ``task`` picks the head (``causal-lm``, ``masked-lm``,
  ``sequence-classification``; default: the config's ``architectures``, else
  masked-lm for encoders such as BERT, else causal-lm). The model is built from
  the config alone (``AutoModelFor*.from_config``): no hub access, no remote code.
* a ``package.module:factory`` returning a stock ``transformers`` model.

:func:`adapt` makes either traceable and splittable without changing its
parameters or their names (``save_pretrained`` layouts stay valid):

* ``forward(input_ids)`` returns the logits tensor instead of a ``ModelOutput``,
  with the KV cache off;
* attention runs the library's own SDPA function under a name with no mask
  builder registered, so the library passes no mask and SDPA applies causality
  itself (``is_causal``; bidirectional for encoders). No ``[B, 1, T, T]`` mask
  is ever materialised, so none crosses a stage cut, and the mask code that
  reads tensor values (``.item()`` on meta tensors) never runs;
* decoder layers that take ``position_embeddings`` (Llama, Mistral, Qwen2, ...)
  compute their positions and rotary tables themselves, inside the layer, so
  each layer's block holds its own tables and only the hidden state crosses a
  cut (the model-level tables become dead code, computed once and unread; ``models.hf_rotary``).

This is exact for what Stagewise trains: full sequences without padding or a
cache. Sliding-window attention is exact only up to the window, so a longer
sequence is refused. The training loss is the library's own loss function for
the head (:class:`HFLoss`).

``transformers`` is an optional dependency (``pip install -e '.[hf]'``),
imported only when an ``hf:`` spec or a transformers model is met.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import logging
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
from torch import nn

from models.hf_rotary import own_rotary_tables
from planner.errors import InvalidInputError, first_line

PREFIX = "hf:"
Task = Literal["causal-lm", "masked-lm", "sequence-classification"]
TASKS: tuple[str, ...] = ("causal-lm", "masked-lm", "sequence-classification")
# The library's SDPA attention under our own name: with no mask function registered for it,
# the library's mask builders return None (their "custom attention backend" exit).
ATTENTION = "stagewise_sdpa"
# Default sequence length: the config's position limit, capped (Qwen2 allows 32768).
MAX_DEFAULT_SEQ = 4096
_TASK_KEY = "task"
# Config sizes (the library's standard names; a config's attribute_map aliases them) that must be >= 1.
_SIZE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "max_position_embeddings")
_CODE_KEYS = frozenset({"auto_map", "trust_remote_code", "custom_pipelines"})  # how a config asks for its own code
_MAPPINGS = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"}
_AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
                 "sequence-classification": "AutoModelForSequenceClassification"}
_LOSSES = {"causal-lm": "ForCausalLM", "masked-lm": "ForMaskedLM",
           "sequence-classification": "ForSequenceClassification"}
_INSTALL = "pip install -e '.[hf]' (or pip install 'transformers>=4.53')"
SUPPORTED = ("decoder-only causal LMs (gpt2, llama, mistral, qwen2, ...) and encoders with a masked-LM or "
             "sequence-classification head (bert, roberta, ...)")


@dataclass(frozen=True, slots=True, kw_only=True)
class HFSpec:
    """A parsed ``hf:`` spec: a model type or a config path, overrides, and an optional head."""

    spec: str
    source: str
    is_path: bool
    overrides: tuple[tuple[str, Any], ...] = ()
    task: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HFLoss:
    """The library's loss for a head, as ``loss(logits, targets)`` on one microbatch.

    Causal LMs get ``targets`` already shifted (the next token of each position), which the
    library's causal loss takes as ``shift_labels``; -100 marks ignored positions as in the library.
    """

    task: str
    num_labels: int = 0
    problem_type: str | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = importlib.import_module("transformers.loss.loss_utils").LOSS_MAPPING
        fn = losses[_LOSSES[self.task]]
        logits, targets = logits.contiguous(), targets.contiguous()  # the library flattens with .view
        if self.task == "causal-lm":
            return fn(logits, None, vocab_size=int(logits.shape[-1]), shift_labels=targets)
        if self.task == "masked-lm":
            return fn(logits, targets, vocab_size=int(logits.shape[-1]))
        # The library decides regression / single / multi label from the config, and records it there.
        config = types.SimpleNamespace(num_labels=self.num_labels, problem_type=self.problem_type)
        return fn(targets, logits, config)


@dataclass(frozen=True, slots=True, kw_only=True)
class HFModel:
    """What :func:`adapt` learned about a transformers model."""

    task: str
    vocab_size: int
    max_positions: int | None  # a hard limit for learned positions; None for rotary models
    sliding_window: int | None
    loss: HFLoss


def is_hf_spec(spec: str) -> bool:
    """``hf:`` is a reserved prefix: such a spec never names a Python module."""
    return spec.startswith(PREFIX)


def is_hf_model(module: nn.Module) -> bool:
    """A ``transformers`` model (checked without importing the library: a factory that made one did)."""
    library = sys.modules.get("transformers")
    return library is not None and isinstance(module, library.PreTrainedModel)


# ---------------------------------------------------------------------------- the spec

def parse_hf_spec(spec: str) -> HFSpec:
    """Split ``hf:SOURCE?key=value,...``; raises :class:`InvalidInputError` on a malformed spec."""
    if not is_hf_spec(spec):
        raise InvalidInputError(f"model spec {spec!r}", expected="hf:CONFIG")
    source, has_query, query = spec[len(PREFIX):].partition("?")
    if not source:
        raise InvalidInputError(f"model spec {spec!r}", expected="hf:MODEL_TYPE or hf:PATH/config.json",
                                found="nothing after 'hf:'", fix="e.g. hf:llama?num_hidden_layers=4")
    overrides: dict[str, Any] = {}
    for item in query.split(",") if has_query else ():
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or not key.isidentifier() or not raw:
            raise InvalidInputError(f"override {item!r} in model spec {spec!r}", expected="key=value",
                                    fix="e.g. hf:llama?hidden_size=512,num_hidden_layers=4")
        if key in overrides:
            raise InvalidInputError(f"override {key!r} in model spec {spec!r}", expected="each key once",
                                    found="it twice")
        overrides[key] = _scalar(raw)
    task = overrides.pop(_TASK_KEY, None)
    if task is not None and task not in TASKS:
        raise InvalidInputError(f"task={task} in model spec {spec!r}", expected=f"one of {', '.join(TASKS)}")
    is_path = "/" in source or os.sep in source or source.endswith(".json") or Path(source).is_dir()
    return HFSpec(spec=spec, source=source, is_path=is_path, overrides=tuple(overrides.items()), task=task)


def _scalar(raw: str) -> Any:
    """A JSON scalar (``512``, ``1e-5``, ``true``, ``null``), else the text itself."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, (int, float, bool, str)) or value is None else raw


def load_config(hs: HFSpec) -> Any:
    """The ``PretrainedConfig`` of a spec: a type's defaults or a JSON file, with the overrides applied."""
    library = transformers()
    mapping = library.models.auto.configuration_auto.CONFIG_MAPPING
    values = _read_json(hs) if hs.is_path else {"model_type": hs.source}
    code_keys = sorted(k for k in (*values, *dict(hs.overrides)) if k in _CODE_KEYS)
    if code_keys:  # a config names custom code only through these keys; none is ever honoured
        raise InvalidInputError(f"model spec {hs.spec!r} names custom code ({code_keys[0]})",
                                expected="a config of a model type transformers ships (data only)",
                                fix=f"remove {code_keys[0]} from the config: Stagewise never runs a model's own code")
    model_type = values.pop("model_type", None)
    if model_type not in mapping:
        close = difflib.get_close_matches(str(model_type), list(mapping.keys()), n=3)
        where = f"model_type in {hs.source}" if hs.is_path else f"model type {model_type!r}"
        raise InvalidInputError(f"unknown {where} in {hs.spec!r}",
                                expected="a model type this transformers knows (e.g. gpt2, llama, bert)",
                                found=repr(model_type),
                                fix=f"did you mean {', '.join(close)}?" if close else
                                "check the name, or upgrade transformers")
    config_class = mapping[model_type]
    with quiet():
        defaults = config_class()
    for key, _ in hs.overrides:
        if key not in values and not hasattr(defaults, key):
            known = [k for k in defaults.to_dict() if not k.startswith("_")]
            close = difflib.get_close_matches(key, known, n=3)
            raise InvalidInputError(f"unknown config key {key!r} for {model_type} in {hs.spec!r}",
                                    expected=f"a key of {config_class.__name__}",
                                    fix=f"did you mean {', '.join(close)}?" if close else
                                    "see the model's config.json for its keys")
    try:
        with quiet():
            config = config_class.from_dict({**values, **dict(hs.overrides)})
    except (ValueError, TypeError, KeyError, AttributeError, *_strict_errors()) as exc:
        raise InvalidInputError(f"config of {hs.spec!r}", expected="values the model accepts",
                                found=_one_line(exc)) from None
    _check_sizes(config, hs)
    return config


def _strict_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's error for a config field of the wrong type (transformers 5 validates them; it is
    no ValueError), where the installed version has it."""
    try:
        errors = importlib.import_module("huggingface_hub.errors")
    except ImportError:
        return ()
    strict = getattr(errors, "StrictDataclassError", None)
    return (strict,) if isinstance(strict, type) and issubclass(strict, Exception) else ()


def _check_sizes(config: Any, hs: HFSpec) -> None:
    """Refuse a layer count or width below 1: the library builds a model of 0 layers without a word."""
    aliases = getattr(config, "attribute_map", None) or {}
    for name in _SIZE_KEYS:
        value = getattr(config, name, None)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            continue
        if isinstance(value, (int, float)):  # bools and floats too; other shapes (per-layer lists) pass
            key = aliases.get(name, name)
            raise InvalidInputError(f"{key}={value!r} in model spec {hs.spec!r}", expected="a whole number >= 1",
                                    fix=f"e.g. {key}=2")


def _read_json(hs: HFSpec) -> dict[str, Any]:
    path = Path(hs.source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InvalidInputError(f"model spec {hs.spec!r}: no config file {str(path)!r}",
                                expected="a config.json, or a model folder holding one",
                                fix="check the path (a folder from save_pretrained has config.json)")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError(f"config file {str(path)!r}", expected="a JSON object",
                                found=first_line(exc)) from None
    if not isinstance(values, dict):
        raise InvalidInputError(f"config file {str(path)!r}", expected="a JSON object",
                                found=type(values).__name__)
    return values


def refuse_unsupported(config: Any) -> None:
    """Refuse by name a model kind Stagewise cannot split: encoder-decoders take two input streams."""
    if not getattr(config, "is_encoder_decoder", False):
        return
    auto = transformers().models.auto.modeling_auto
    arch = (getattr(config, "architectures", None) or [None])[0] or \
        auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(config.model_type) or config.model_type
    raise InvalidInputError(f"{arch} (encoder-decoder) is not supported", expected=f"one of: {SUPPORTED}",
                            found=f"model type {config.model_type!r}, an encoder-decoder",
                            fix="pick a decoder-only or encoder-only model")


def choose_task(config: Any, requested: str | None) -> str:
    """The head: the requested one, else the config's ``architectures``, else by model type."""
    refuse_unsupported(config)
    names = _head_names(config.model_type)
    if requested is not None:
        if names.get(requested) is None:
            raise InvalidInputError(f"task={requested} for {config.model_type}",
                                    expected=f"one of {', '.join(t for t, n in names.items() if n) or 'no task'}")
        return requested
    for arch in getattr(config, "architectures", None) or ():
        for task, name in names.items():
            if arch == name:
                return task
    for task in ("masked-lm", "causal-lm", "sequence-classification"):  # encoders are masked LMs
        if names.get(task):
            return task
    raise InvalidInputError(f"model type {config.model_type!r} is not supported",
                            expected="a model with a causal-LM, masked-LM or sequence-classification head: "
                            + SUPPORTED,
                            found="none of them")


def _head_names(model_type: str) -> dict[str, str | None]:
    auto = transformers().models.auto.modeling_auto
    return {task: getattr(auto, mapping).get(model_type) for task, mapping in _MAPPINGS.items()}


# ---------------------------------------------------------------------------- building

def build(spec: str, device: torch.device, seed: int) -> nn.Module:
    """The adapted model of an ``hf:`` spec on ``device`` (meta: no weights), seeded like a factory."""
    hs = parse_hf_spec(spec)
    config = load_config(hs)
    task = choose_task(config, hs.task)
    library = transformers()
    _register_attention(library)
    auto = getattr(library, _AUTO_CLASSES[task])
    with torch.random.fork_rng(devices=[]), torch.device(device), quiet():
        torch.manual_seed(seed)
        try:
            model = auto.from_config(config, attn_implementation=ATTENTION)
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, AssertionError,
                ArithmeticError, *_strict_errors()) as exc:
            raise InvalidInputError(f"cannot build {spec!r}", expected="a config the model accepts",
                                    found=_one_line(exc)) from None
    return model


def adapt(model: nn.Module) -> HFModel:
    """Make a transformers model traceable and splittable in place (module docstring); idempotent."""
    library = transformers()
    task = _task_of(model)
    config = model.config
    _use_attention(model, library)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    if "forward" not in vars(model):
        model.forward = types.MethodType(_logits_forward, model)
    rotary = own_rotary_tables(model)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    limit = getattr(config, "max_position_embeddings", None)
    loss = HFLoss(task=task, num_labels=int(getattr(config, "num_labels", 0) or 0),
                  problem_type=getattr(config, "problem_type", None))
    return HFModel(task=task, vocab_size=int(config.vocab_size), max_positions=None if rotary else limit,
                   sliding_window=window if isinstance(window, int) else None, loss=loss)


def adapt_if_hf(model: nn.Module) -> HFModel | None:
    """:func:`adapt` a transformers model (as ``hf:`` specs and factories are); None for any other module."""
    return adapt(model) if is_hf_model(model) else None


def example_seq(model: nn.Module, info: HFModel, seq: int | None, spec: str) -> int:
    """The sequence length to trace at: ``seq`` checked against the model's limits, or its default."""
    limit = getattr(model.config, "max_position_embeddings", None)
    chosen = seq if seq is not None else min(limit or MAX_DEFAULT_SEQ, MAX_DEFAULT_SEQ)
    if info.max_positions is not None and chosen > info.max_positions:
        raise InvalidInputError(f"--seq {chosen} for {spec}",
                                expected=f"at most {info.max_positions} (its learned position table)",
                                fix=f"pass --seq {info.max_positions} or less, or raise max_position_embeddings")
    if info.sliding_window is not None and chosen > info.sliding_window:
        raise InvalidInputError(f"--seq {chosen} for {spec}",
                                expected=f"at most its sliding window of {info.sliding_window} tokens",
                                fix="pass a shorter --seq (attention runs without a mask, exact up to the window)")
    return chosen


def _task_of(model: nn.Module) -> str:
    name = type(model).__name__
    refuse_unsupported(model.config)
    for task, head in _head_names(model.config.model_type).items():
        if head == name:
            return task
    raise InvalidInputError(f"transformers model {name} is not supported",
                            expected="a model with a causal-LM, masked-LM or sequence-classification head "
                            f"(AutoModelForCausalLM / ForMaskedLM / ForSequenceClassification): {SUPPORTED}",
                            found=f"{name} ({model.config.model_type})")


def _register_attention(library: Any) -> None:
    interface = library.modeling_utils.AttentionInterface
    if ATTENTION not in interface._global_mapping:
        sdpa = importlib.import_module("transformers.integrations.sdpa_attention").sdpa_attention_forward
        interface.register(ATTENTION, sdpa)


def _use_attention(model: nn.Module, library: Any) -> None:
    _register_attention(library)
    setter = getattr(model, "set_attn_implementation", None)
    if model.config._attn_implementation != ATTENTION:
        if callable(setter):
            setter(ATTENTION)
        else:
            model.config._attn_implementation = ATTENTION


def _logits_forward(self: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``forward(input_ids) -> logits``: the stock forward, without the ModelOutput wrapper."""
    out = type(self).forward(self, input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out[0]


# ---------------------------------------------------------------------------- the library

def transformers() -> Any:
    """The ``transformers`` module, offline; one clear error when it is not installed."""
    if "transformers" not in sys.modules:
        # Nothing here downloads, but make sure no code path of the library reaches the hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        library = importlib.import_module("transformers")
        importlib.import_module("transformers.masking_utils")
    except ImportError as exc:
        raise InvalidInputError("Hugging Face models (hf: specs and transformers factories) need the "
                                "transformers library", expected="transformers>=4.53 installed",
                                found=first_line(exc), fix=_INSTALL) from None
    return library


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the library's advice while building (token ids outside a byte vocabulary, etc.)."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _one_line(exc: BaseException) -> str:
    """The whole message on one line (huggingface_hub puts the useful part on the second)."""
    text = " ".join(str(exc).split())
    return text or f"{type(exc).__name__} with no message"

