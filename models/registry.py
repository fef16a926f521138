"""Model presets and ``build_model``: a preset name, ``hf:CONFIG`` or ``package.module:factory`` -> ``ModelBundle``.

``build_model(spec, device="meta")`` constructs under ``torch.device("meta")``:
no weight memory, so a 7B preset builds in well under a second. Any other
device builds on meta too, then materialises (``to_empty``) and initialises
deterministically from ``seed`` (see ``models.init_parameters``).
``hf:`` specs and factories returning a ``transformers`` model are adapted by
``models.hf`` (logits out, no mask tensors, per-layer rotary tables, the
library's own loss).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Literal, Mapping, Union

import torch
import torch.nn.functional as F
from torch import nn

from models import hf, stable_seed
from models.cnn import CNN, CNNConfig
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from models.mlp import MLP, MLPConfig
from planner.errors import InvalidInputError, PlannerError, first_line

Family = Literal["lm", "classifier"]
SpecKind = Literal["preset", "hf", "onnx", "api", "factory"]
API_PREFIX = "python:"  # planner.api labels a plan of an in-memory model so; reserved, like hf:
ONNX_SUFFIX = ".onnx"
ModelConfig = Union[GPTConfig, LlamaConfig, MLPConfig, CNNConfig]

_MODEL_CLASSES: Mapping[type, type[nn.Module]] = {
    GPTConfig: GPT, LlamaConfig: Llama, MLPConfig: MLP, CNNConfig: CNN}

# Errors user factories commonly raise; anything rarer propagates with its traceback.
_USER_CODE_ERRORS = (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                     ImportError, NotImplementedError, AssertionError, OSError, ArithmeticError, NameError)


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    name: str
    config: ModelConfig
    description: str

    def __post_init__(self) -> None:
        if type(self.config) not in _MODEL_CLASSES:
            raise InvalidInputError(f"preset {self.name!r} config", expected="a GPT/Llama/MLP/CNN config",
                                    found=type(self.config).__name__)

    @property
    def family(self) -> Family:
        return "lm" if isinstance(self.config, (GPTConfig, LlamaConfig)) else "classifier"

    @property
    def vocab_or_classes(self) -> int:
        return self.config.vocab_size if self.family == "lm" else self.config.n_classes

    def build(self) -> nn.Module:
        """The module, on the current default device, with PyTorch's default init."""
        return _MODEL_CLASSES[type(self.config)](self.config)


def _presets(*items: Preset) -> Mapping[str, Preset]:
    return MappingProxyType({p.name: p for p in items})


PRESETS: Mapping[str, Preset] = _presets(
    Preset(name="gpt-tiny", description="4-layer byte-level GPT for tests (d=64)",
           config=GPTConfig(vocab_size=256, max_seq=32, n_layers=4, d_model=64, n_heads=4)),
    Preset(name="gpt-small", description="GPT-2 small, 124M tied / 163M untied",
           config=GPTConfig(vocab_size=50257, max_seq=1024, n_layers=12, d_model=768, n_heads=12)),
    Preset(name="gpt-medium", description="GPT-2 medium, 355M tied",
           config=GPTConfig(vocab_size=50257, max_seq=1024, n_layers=24, d_model=1024, n_heads=16)),
    Preset(name="gpt-1.3b", description="GPT-3 XL class, 1.3B tied",
           config=GPTConfig(vocab_size=50257, max_seq=2048, n_layers=24, d_model=2048, n_heads=16)),
    Preset(name="llama-tiny", description="4-layer byte-level Llama with GQA for tests (d=64)",
           config=LlamaConfig(vocab_size=256, max_seq=32, n_layers=4, d_model=64, n_heads=4,
                              n_kv_heads=2, d_ff=176)),
    Preset(name="llama-small", description="12-layer Llama with GQA (d=768, 4 kv heads)",
           config=LlamaConfig(vocab_size=32000, max_seq=1024, n_layers=12, d_model=768, n_heads=12,
                              n_kv_heads=4, d_ff=2048)),
    Preset(name="llama-7b", description="Llama-2-7B shape, 6.74B",
           config=LlamaConfig(vocab_size=32000, max_seq=4096, n_layers=32, d_model=4096, n_heads=32,
                              n_kv_heads=32, d_ff=11008)),
    Preset(name="mlp-tiny", description="4 residual blocks on 32 features, 10 classes",
           config=MLPConfig(d_in=32, d_model=64, d_ff=128, n_layers=4, n_classes=10)),
    Preset(name="mlp-small", description="8 residual blocks on 784 features (d=1024), 10 classes",
           config=MLPConfig(d_in=784, d_model=1024, d_ff=4096, n_layers=8, n_classes=10)),
    Preset(name="cnn-tiny", description="3 residual blocks on 3x16x16, 10 classes",
           config=CNNConfig(widths=(16, 32, 64), blocks=(1, 1, 1), n_classes=10, image_size=16)),
    Preset(name="cnn-small", description="ResNet-18-like on 3x32x32, 10 classes",
           config=CNNConfig(widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), n_classes=10, image_size=32)),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelBundle:
    """A built model with example inputs. ``vocab_or_classes`` is the last logits dimension."""

    name: str
    spec: str
    module: nn.Module = field(hash=False, compare=False)
    example_inputs: tuple[torch.Tensor, ...] = field(hash=False, compare=False)
    family: Family
    vocab_or_classes: int
    preset: Preset | None = None  # None for factory specs
    # The model's own training loss (a transformers head's); None: cross entropy by family (``loss_fn``).
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, hash=False,
                                                                              compare=False)

    def __post_init__(self) -> None:
        if self.family not in ("lm", "classifier"):
            raise InvalidInputError("ModelBundle.family", expected="'lm' or 'classifier'", found=repr(self.family))
        if not self.example_inputs or not all(isinstance(t, torch.Tensor) for t in self.example_inputs):
            raise InvalidInputError(f"example inputs of {self.spec!r}", expected="a non-empty tuple of tensors",
                                    found=repr(self.example_inputs))


def build_model(spec: str, *, batch: int = 1, seq: int | None = None, device: str = "meta",
                seed: int = 0) -> ModelBundle:
    """Build a preset, an ``hf:CONFIG`` or a ``package.module:factory`` model with example inputs of
    ``batch`` x ``seq``.

    ``seq`` is the sequence length for LMs (default: the preset's ``max_seq``, a
    transformers config's position limit up to 4096) and the image side for CNNs
    (default: the preset's ``image_size``); MLPs take none. A factory is called
    with no arguments under ``torch.device(device)`` and a seeded RNG; it returns
    a module or ``(module, example_inputs)``. ``hf:`` is reserved (``models.hf``); ``python:`` labels and
    ``.onnx`` files are refused (:func:`spec_kind`).
    """
    if batch < 1 or (seq is not None and seq < 1):
        raise InvalidInputError("batch/seq", expected="batch >= 1 and seq >= 1", found=f"batch={batch}, seq={seq}")
    dev = _device(device)
    kind = spec_kind(spec)
    if kind == "hf":
        return _build_hf(spec, hf.build(spec, dev, seed), None, batch, seq, dev, seed)
    if kind in ("api", "onnx"):
        raise _unbuildable(spec, kind)
    if kind == "factory":
        return _build_factory(spec, batch, seq, dev, seed)
    return _build_preset(spec, batch, seq, dev, seed)


def spec_kind(spec: str) -> SpecKind:
    """What a model spec names, by one rule that ``build_model`` dispatches on: ``hf`` (a transformers
    config: data), ``onnx`` (a file, read by ``planner.model_io``), ``api`` (the label ``python:MODULE.CLASS``
    of a plan made from an in-memory model: never imported), ``factory`` (``package.module:factory``: importing
    it runs code) or ``preset`` (anything else: looked up in ``PRESETS``, never imported)."""
    if hf.is_hf_spec(spec):
        return "hf"
    if spec.lower().endswith(ONNX_SUFFIX):
        return "onnx"
    if spec.startswith(API_PREFIX):
        return "api"
    return "factory" if ":" in spec else "preset"


def is_data_spec(spec: str) -> bool:
    """A spec that builds a model from data alone (a known preset, an ``hf:`` config, an ONNX file): the only
    kind a plan file may name without the operator naming it too (every other spec could import code)."""
    kind = spec_kind(spec)
    return kind in ("hf", "onnx") or (kind == "preset" and spec in PRESETS)


def _unbuildable(spec: str, kind: SpecKind) -> InvalidInputError:
    if kind == "onnx":
        return InvalidInputError(f"model {spec!r} is an ONNX file", expected="a preset, hf: config or "
                                 "package.module:factory", fix="read it with planner.model_io.load_graph")
    return InvalidInputError(f"model {spec!r} names a model the Python API planned in memory",
                             expected="a preset, hf: config or package.module:factory (a python: label is "
                                      "never imported)", fix="pass the model itself (apply_plan), or plan a factory")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every token: logits ``[B, T, V]``, targets ``[B, T]``."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def classifier_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy: logits ``[B, C]``, targets ``[B]``."""
    return F.cross_entropy(logits, targets)


def loss_fn(bundle: ModelBundle) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of ``bundle``: the model's own, else cross entropy by family (both pickle)."""
    if bundle.loss is not None:
        return bundle.loss
    return lm_loss if bundle.family == "lm" else classifier_loss


# ---------------------------------------------------------------------------- presets

def _build_preset(spec: str, batch: int, seq: int | None, dev: torch.device, seed: int) -> ModelBundle:
    if spec not in PRESETS:
        close = difflib.get_close_matches(spec, PRESETS, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "use one of the presets or package.module:factory"
        raise InvalidInputError(f"unknown model {spec!r}", expected=f"one of {', '.join(PRESETS)}",
                                fix=hint)
    preset = _with_seq(PRESETS[spec], seq)
    with torch.device("meta"):
        module = preset.build()
    if dev.type != "meta":
        module.to_empty(device=dev)
        module.init_weights(seed)
    inputs = (_preset_input(preset, batch, seq, dev, seed),)
    return ModelBundle(name=spec, spec=spec, module=module, example_inputs=inputs, family=preset.family,
                       vocab_or_classes=preset.vocab_or_classes, preset=preset)


def _with_seq(preset: Preset, seq: int | None) -> Preset:
    """The preset adjusted for a requested ``seq`` (rotary tables and image size stretch;
    learned GPT positions and MLP inputs do not)."""
    cfg = preset.config
    if seq is None:
        return preset
    if isinstance(cfg, GPTConfig) and seq > cfg.max_seq:
        raise InvalidInputError(f"--seq {seq} for {preset.name}",
                                expected=f"at most {cfg.max_seq} (its learned position table)",
                                fix=f"pass --seq {cfg.max_seq} or less")
    if isinstance(cfg, LlamaConfig) and seq > cfg.max_seq:
        return dataclasses.replace(preset, config=dataclasses.replace(cfg, max_seq=seq))
    if isinstance(cfg, CNNConfig):
        return dataclasses.replace(preset, config=dataclasses.replace(cfg, image_size=seq))
    if isinstance(cfg, MLPConfig):
        raise InvalidInputError(f"--seq {seq} for {preset.name}", expected="no sequence length (an MLP "
                                f"takes [batch, {cfg.d_in}])", fix="omit --seq")
    return preset


def _preset_input(preset: Preset, batch: int, seq: int | None, dev: torch.device, seed: int) -> torch.Tensor:
    cfg = preset.config
    if isinstance(cfg, (GPTConfig, LlamaConfig)):
        return _example(dev, seed, (batch, seq or cfg.max_seq), torch.long, cfg.vocab_size)
    if isinstance(cfg, MLPConfig):
        return _example(dev, seed, (batch, cfg.d_in), torch.float32, 0)
    return _example(dev, seed, (batch, cfg.in_channels, cfg.image_size, cfg.image_size), torch.float32, 0)


def _example(dev: torch.device, seed: int, shape: tuple[int, ...], dtype: torch.dtype, high: int) -> torch.Tensor:
    """Example input: shape-only on meta, else deterministic values drawn on the CPU."""
    if dev.type == "meta":
        return torch.empty(shape, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(stable_seed(seed, "example_inputs"))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype).to(dev)
    return torch.randint(0, high, shape, generator=gen, dtype=dtype).to(dev)


# ---------------------------------------------------------------------------- factories

def _build_factory(spec: str, batch: int, seq: int | None, dev: torch.device, seed: int) -> ModelBundle:
    factory = _resolve_factory(spec)
    with torch.random.fork_rng(devices=[]), torch.device(dev):
        torch.manual_seed(seed)
        try:
            made = factory()
        except PlannerError:
            raise
        except _USER_CODE_ERRORS as exc:
            raise InvalidInputError(f"model factory {spec!r} raised {type(exc).__name__}",
                                    found=first_line(exc),
                                    fix=f"check that it runs on its own: {_repro(spec)}") from exc
    module, inputs = _split_factory_result(spec, made)
    if dev.type == "meta":
        module = _to_meta(module)  # drops any real weights the factory allocated anyway
    if hf.is_hf_model(module):
        return _build_hf(spec, module, inputs, batch, seq, dev, seed)
    if inputs is None:
        inputs = (_infer_input(spec, module, batch, seq, dev, seed),)
    inputs = tuple(t.to(dev) if dev.type == "meta" else t for t in inputs)
    family, width = _probe_family(spec, module, inputs)
    return ModelBundle(name=spec.rpartition(":")[2], spec=spec, module=module, example_inputs=inputs,
                       family=family, vocab_or_classes=width)


def _to_meta(module: nn.Module) -> nn.Module:
    """``module.to("meta")`` keeping tied parameters tied (``.to`` makes one new tensor per owner,
    which would count a tied embedding twice)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((owner, name))
    module = module.to("meta")
    for refs in owners.values():
        first_owner, first_name = refs[0]
        for owner, name in refs[1:]:
            owner._parameters[name] = first_owner._parameters[first_name]
    return module


def _build_hf(spec: str, module: nn.Module, inputs: tuple[torch.Tensor, ...] | None, batch: int,
              seq: int | None, dev: torch.device, seed: int) -> ModelBundle:
    """A transformers model, adapted in place (``models.hf.adapt``), with token-id example inputs."""
    info = hf.adapt(module)
    if inputs is None:
        length = hf.example_seq(module, info, seq, spec)
        inputs = (_example(dev, seed, (batch, length), torch.long, info.vocab_size),)
    family, width = _probe_family(spec, module, inputs)
    name = spec if hf.is_hf_spec(spec) else spec.rpartition(":")[2]
    return ModelBundle(name=name, spec=spec, module=module, example_inputs=inputs, family=family,
                       vocab_or_classes=width, loss=info.loss)


def _resolve_factory(spec: str) -> Callable[[], object]:
    module_name, _, attr_path = spec.partition(":")
    if not _dotted(module_name) or not _dotted(attr_path):
        raise InvalidInputError(f"model spec {spec!r}", expected="package.module:factory (dotted Python names, "
                                "no spaces)", found=f"module {module_name!r}, factory {attr_path!r}",
                                fix="name both parts exactly")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"cannot import {module_name!r} for model {spec!r}", expected="an importable module",
                                found=first_line(exc),
                                fix="check the module path and that its folder is on PYTHONPATH") from None
    except SyntaxError as exc:
        raise InvalidInputError(f"cannot import {module_name!r} for model {spec!r}", expected="valid Python",
                                found=f"a syntax error at {exc.filename}:{exc.lineno}",
                                fix="fix the syntax error") from None
    except _USER_CODE_ERRORS as exc:
        raise InvalidInputError(f"importing {module_name!r} for model {spec!r} raised {type(exc).__name__}",
                                found=first_line(exc),
                                fix=f"check that it runs on its own: python -c 'import {module_name}'") from exc
    for part in attr_path.split("."):
        if not hasattr(target, part):
            close = difflib.get_close_matches(part, [n for n in dir(target) if not n.startswith("_")], n=3)
            raise InvalidInputError(f"{module_name!r} has no attribute {attr_path!r}",
                                    expected=f"a factory named {part!r}", found="no such attribute",
                                    fix=f"did you mean {', '.join(close)}?" if close else "check the factory name")
        target = getattr(target, part)
    if not callable(target):
        raise InvalidInputError(f"model factory {spec!r}", expected="a callable returning an nn.Module",
                                found=type(target).__name__)
    return target


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))



def _repro(spec: str) -> str:
    module_name, _, attr_path = spec.partition(":")
    return f"python -c 'import {module_name}; {module_name}.{attr_path}()'"


def _split_factory_result(spec: str, made: object) -> tuple[nn.Module, tuple[torch.Tensor, ...] | None]:
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        inputs = made[1]
        if isinstance(inputs, torch.Tensor):
            return made[0], (inputs,)
        if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
            return made[0], tuple(inputs)
    raise InvalidInputError(f"model factory {spec!r} result", expected="an nn.Module or (module, example_inputs)"
                            " with example_inputs a tensor or a tuple of tensors", found=_describe(made))


def _describe(obj: object) -> str:
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__} of ({', '.join(type(x).__name__ for x in obj)})"
    return type(obj).__name__


def infer_example_inputs(module: nn.Module, *, batch: int, seq: int | None = None,
                         name: str = "model") -> tuple[torch.Tensor, ...]:
    """Meta example inputs for ``module`` guessed from its first layer (see ``_infer_input``)."""
    return (_infer_input(name, module, batch, seq, torch.device("meta"), 0),)


def _infer_input(spec: str, module: nn.Module, batch: int, seq: int | None, dev: torch.device,
                 seed: int) -> torch.Tensor:
    """Guess the input from the first module that owns parameters (registration order)."""
    first = next((m for m in module.modules() if next(m.parameters(recurse=False), None) is not None), None)
    side = seq or 32
    if isinstance(first, nn.Embedding):
        return _example(dev, seed, (batch, side), torch.long, first.num_embeddings)
    if isinstance(first, nn.Linear):
        return _example(dev, seed, (batch, first.in_features), torch.float32, 0)
    if isinstance(first, nn.Conv2d):
        return _example(dev, seed, (batch, first.in_channels, side, side), torch.float32, 0)
    if isinstance(first, nn.Conv1d):
        return _example(dev, seed, (batch, first.in_channels, side), torch.float32, 0)
    raise InvalidInputError(f"cannot infer the input of model {spec!r}",
                            expected="a first layer that is an Embedding, Linear or Conv",
                            found=type(first).__name__ if first is not None else "no parameters",
                            fix="make the factory return (module, example_inputs)")


def _probe_family(spec: str, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Family, int]:
    """Run the model once (free on meta) to learn its logits shape."""
    try:
        with torch.no_grad():
            out = module(*inputs)
    except _USER_CODE_ERRORS as exc:
        raise InvalidInputError(f"model {spec!r} fails on its example inputs "
                                f"{[tuple(t.shape) for t in inputs]}", expected="a forward pass that runs",
                                found=first_line(exc),
                                fix="make the factory return (module, example_inputs)") from exc
    if isinstance(out, torch.Tensor) and out.ndim == 3:
        return "lm", int(out.shape[-1])
    if isinstance(out, torch.Tensor) and out.ndim == 2:
        return "classifier", int(out.shape[-1])
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    raise InvalidInputError(f"output of model {spec!r}", expected="logits [B, T, vocab] or [B, classes]",
                            found=str(shape))


def _device(device: str) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise InvalidInputError(f"device {device!r}", expected="a torch device such as 'meta', 'cpu', 'cuda:0'",
                                found=first_line(exc), fix="use 'meta', 'cpu' or 'cuda[:N]'") from None
