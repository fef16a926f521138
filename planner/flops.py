"""FLOP counts per op, shared by the PyTorch and the ONNX frontends.

Conventions (one multiply-add = 2 FLOPs, as in ``torch.utils.flop_counter``):

- Matmul-like ops (mm, addmm, bmm, baddbmm, convolutions, attention) are counted
  by ``torch.utils.flop_counter.FlopCounterMode`` on meta tensors, forward and
  backward, using PyTorch's registered formulas. The CPU flash-attention ops
  have no registered formula (they count zero), so :func:`sdpa_custom_mapping`
  maps them onto ``sdpa_flop_count`` / ``sdpa_backward_flop_count``.
- Everything else is counted per aten op as it reaches the dispatcher (after
  CompositeImplicit decomposition, by :class:`_TableCounter`) with a small table:
  pointwise ops (``torch.Tag.pointwise``) 1 FLOP per output element; reductions
  1 per input element; softmax and normalisation a constant per element (below).
  On meta tensors attention runs PyTorch's math path, so its scale, mask add and
  softmax are counted this way, like the pieces an ONNX exporter emits; a fused
  kernel (CPU flash attention) hides them, and then
  :data:`ATTN_SCORE_FLOPS_PER_ELEMENT` per score is added instead.
- Data movement (copies, casts, concatenation, gathers, embedding lookups) and
  views: 0 FLOPs. They cost memory traffic, which the blocks count separately.
- ONNX ops (:func:`onnx_fwd_flops`) follow the same table by op type.

Backward FLOPs: the registered backward formulas where an op has them (mm/addmm/
bmm/conv/SDPA backward: about 2x forward when both the input and the weight
need gradients, 1x when only one does). Elsewhere we assume about 1x forward
when any input needs a gradient, else 0: a pointwise backward multiplies the
incoming gradient by a local derivative, which is the same order of work. This
is an estimate, not a measurement; the matmul terms dominate every model we
plan for.

Input-gradient FLOPs (``bwd_input_flops``): the part of the backward that an
audit's recompute runs when it asks autograd for the stage input's gradient
alone (``runtime.rank.audit_copy.grads``): the registered backward formulas
asked for the gradients of the op's activation operands only (a linear layer:
``dX = dY W^T``, half its backward; attention: all of it), and the non-matmul
work wherever an activation operand needs a gradient. The rest of the backward
produces the weights' gradients (``dW = X^T dY``).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SOFTMAX_FLOPS_PER_ELEMENT = 5      # max, subtract, exp, sum, divide
NORM_FLOPS_PER_ELEMENT = 5         # mean, subtract, variance, normalise, affine (LayerNorm/GroupNorm/BatchNorm)
RMS_NORM_FLOPS_PER_ELEMENT = 4     # square, mean, normalise, scale
ATTN_SCORE_FLOPS_PER_ELEMENT = SOFTMAX_FLOPS_PER_ELEMENT + 1  # + scale or mask add

# Ops (by overload-packet name, without the "aten." prefix) that move or create data
# but do no arithmetic. Some are tagged pointwise in PyTorch (clone, copy), hence the list.
_MOVEMENT_OPS = frozenset({
    "clone", "copy", "copy_", "_to_copy", "to", "contiguous", "cat", "stack", "repeat",
    "repeat_interleave", "expand_copy", "index", "index_select", "gather", "scatter",
    "index_put", "embedding", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
    "empty", "empty_like", "empty_strided", "new_zeros", "new_ones", "new_full", "new_empty",
    "arange", "fill", "fill_", "constant_pad_nd", "pad", "flip", "roll", "tril", "triu",
    "lift_fresh_copy", "_assert_tensor_metadata", "scalar_tensor", "masked_fill",
    "detach", "alias", "dropout",
})
_SOFTMAX_OPS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
_NORM_OPS = frozenset({
    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "instance_norm", "cudnn_batch_norm",
})
_RMS_NORM_OPS = frozenset({"rms_norm", "_fused_rms_norm"})
_SDPA_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCost:
    """What one op costs, and whether its output only aliases an input."""

    fwd_flops: int
    bwd_flops: int
    is_view: bool
    outputs_require_grad: tuple[bool, ...] = ()
    bwd_input_flops: int = 0   # of bwd_flops, those for the activation operands' gradients (module docstring)

    def __post_init__(self) -> None:
        assert self.fwd_flops >= 0 and self.bwd_flops >= 0, "flop counts are non-negative"
        assert 0 <= self.bwd_input_flops <= self.bwd_flops, "input-gradient flops are part of the backward's"


# --- CPU flash attention: the ops FlopCounterMode cannot see ------------------
def _cpu_flash_fwd(query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args: Any, out_shape=None,
                   **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def sdpa_custom_mapping() -> dict[Any, Callable[..., int]]:
    """``custom_mapping`` for FlopCounterMode covering CPU flash attention (zero otherwise)."""
    aten = torch.ops.aten
    mapping: dict[Any, Callable[..., int]] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_fwd
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_bwd
    return mapping


# --- generic helpers ---------------------------------------------------------
def numel(shape: Iterable[int]) -> int:
    return math.prod(int(d) for d in shape)


def op_short_name(target: Any) -> str:
    """``aten.add.Tensor`` -> ``add``; a Python callable -> its ``__name__``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", type(target).__name__)


def _tags(target: Any) -> tuple[Any, ...]:
    return tuple(getattr(target, "tags", ()) or ())


def table_flops(target: Any, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]) -> int:
    """FLOPs of a non-matmul op from the convention table (module docstring)."""
    name = op_short_name(target)
    if name not in _MOVEMENT_OPS:
        name = name.rstrip("_") or name  # an in-place op costs what its functional form costs
    out_n = max((numel(s) for s in out_shapes), default=0)
    in_n = numel(in_shapes[0]) if in_shapes else 0
    if name in _MOVEMENT_OPS or target is operator.getitem:
        return 0
    if name in _SOFTMAX_OPS:
        return SOFTMAX_FLOPS_PER_ELEMENT * out_n
    if name in _NORM_OPS:
        return NORM_FLOPS_PER_ELEMENT * in_n
    if name in _RMS_NORM_OPS:
        return RMS_NORM_FLOPS_PER_ELEMENT * in_n
    tags = _tags(target)
    if torch.Tag.reduction in tags:
        return in_n
    if torch.Tag.pointwise in tags:
        return out_n
    if target in (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow):
        return out_n  # torch.fx traces Python operators on tensors
    return 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _sdpa_score_elements(args: Sequence[Any]) -> int:
    """``B*H*L*S`` of an attention call from its query and key (``[..., L, E]``, ``[..., S, E]``)."""
    q, k = args[0], args[1]
    return numel(q.shape[:-1]) * int(k.shape[-2])


class _TableCounter(TorchDispatchMode):
    """Counts the convention-table FLOPs of every aten op that FlopCounterMode does not count.

    It sees ops after CompositeImplicit decomposition, so ``aten.linear`` arrives as
    ``t`` + ``addmm`` (counted by FlopCounterMode) and a math-path attention as its
    scale, mask add and softmax (counted here), the same pieces an ONNX exporter emits.
    """

    def __init__(self, skip: Iterable[Any]) -> None:
        super().__init__()
        self.flops = 0
        self.saw_softmax = False
        self._skip = frozenset(skip)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket not in self._skip:
            ins = _tensors((args, kwargs))
            self.flops += table_flops(func, [t.shape for t in ins], [o.shape for o in _tensors(out)])
            self.saw_softmax |= op_short_name(func) in _SOFTMAX_OPS
        return out


def measure_op(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
               target: Any, params: Sequence[torch.Tensor] = (),
               weights: Sequence[torch.Tensor] = ()) -> tuple[OpCost, Any]:
    """Run ``fn(*args, **kwargs)`` on meta tensors and count its forward and backward FLOPs.

    ``args``/``kwargs`` hold meta leaf tensors whose ``requires_grad`` says whether
    a gradient flows to them; ``params`` are leaves ``fn`` reads by closure (a
    module's weights); ``weights``: those of ``args``/``kwargs`` whose gradient
    reaches parameters only (a parameter, or a value computed from parameters
    alone), the rest being activations (``OpCost.bwd_input_flops``).
    ``target`` names the op (for the attention rule).
    Returns the cost and the op's result (meta tensors). Raises whatever the op
    raises; the caller then falls back to :func:`table_flops` on recorded shapes.
    """
    mapping = sdpa_custom_mapping()
    inputs = _tensors((args, kwargs))
    # enable_grad restores the grad mode on exit even if the op (e.g. a set_grad_enabled region) fails.
    with torch.enable_grad(), flop_counter.FlopCounterMode(display=False, custom_mapping=mapping) as counter, \
            _TableCounter(counter.flop_registry) as table:
        result = fn(*args, **kwargs)
    outs = _tensors(result)
    grads = tuple(bool(o.requires_grad) for o in outs)
    needs_grad = any(grads)
    if outs and all(_is_alias(o, inputs) for o in outs):
        return OpCost(fwd_flops=0, bwd_flops=0, is_view=True, outputs_require_grad=grads), result
    matmul_fwd = counter.get_total_flops()
    matmul_bwd = _backward_flops(outs, [*inputs, *params], mapping) if needs_grad and matmul_fwd else 0
    other = table.flops
    if matmul_fwd and op_short_name(target) in _SDPA_OPS and not table.saw_softmax:
        other += ATTN_SCORE_FLOPS_PER_ELEMENT * _sdpa_score_elements(args)  # a fused kernel hid its softmax
    # Non-matmul work: about 1x forward in backward (module docstring).
    bwd = matmul_bwd + (other if needs_grad else 0)
    bwd_input = _input_grad_flops(outs, inputs, weights=[*weights, *params], mapping=mapping,
                                  matmul_bwd=matmul_bwd, other=other if needs_grad else 0)
    return OpCost(fwd_flops=matmul_fwd + other, bwd_flops=bwd, is_view=False,
                  outputs_require_grad=grads, bwd_input_flops=bwd_input), result


def _input_grad_flops(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                      weights: Sequence[torch.Tensor], mapping: Mapping[Any, Callable[..., int]],
                      matmul_bwd: int, other: int) -> int:
    """Of an op's backward (``matmul_bwd`` + ``other``), the FLOPs for its activation operands' gradients:
    the registered formulas asked for those alone, and the non-matmul work where any of them needs one."""
    acts = [t for t in inputs if t.requires_grad and not any(t is w for w in weights)]
    if not acts:
        return 0
    if not matmul_bwd or not any(w.requires_grad for w in weights):
        return matmul_bwd + other   # no weight takes a gradient here: the whole backward is the inputs'
    return min(matmul_bwd, _backward_flops(outs, acts, mapping)) + other


def _is_alias(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``out`` is one of ``inputs`` or a view of one (inputs are leaves)."""
    if any(out is t for t in inputs):
        return True
    base = out._base if out._is_view() else None
    return base is not None and any(base is t for t in inputs)


def _backward_flops(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    mapping: Mapping[Any, Callable[..., int]]) -> int:
    """FLOPs of the autograd backward of one op, from the registered backward formulas."""
    diff_outs = [o for o in outs if o.requires_grad]
    leaves = [t for t in inputs if t.requires_grad and t.is_leaf]
    if not diff_outs or not leaves:
        return 0
    with torch.enable_grad(), flop_counter.FlopCounterMode(display=False, custom_mapping=dict(mapping)) as counter:
        # the graph kept: the input gradients' alone are counted on it too (meta tensors, nothing to free)
        torch.autograd.grad(diff_outs, leaves, grad_outputs=[torch.empty_like(o) for o in diff_outs],
                            allow_unused=True, retain_graph=True)
    return counter.get_total_flops()


def meta_tensor(shape: Sequence[int], dtype: torch.dtype, *, stride: Sequence[int] | None = None,
                requires_grad: bool = False) -> torch.Tensor:
    """A leaf tensor on the meta device (no memory) with the given layout."""
    rg = requires_grad and (dtype.is_floating_point or dtype.is_complex)
    if stride is None:
        return torch.empty(tuple(shape), dtype=dtype, device="meta", requires_grad=rg)
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device="meta", requires_grad=rg)


# --- ONNX ---------------------------------------------------------------------
ONNX_VIEW_OPS = frozenset({
    "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Transpose", "Slice", "Split",
    "SplitToSequence", "SequenceAt", "Expand",
})
_ONNX_POINTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Exp", "Log", "Tanh", "Sigmoid", "Relu",
    "Gelu", "Erf", "Neg", "Abs", "Max", "Min", "Where", "Cos", "Sin", "Clip", "LeakyRelu", "Elu",
    "Selu", "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Mod", "Sign", "Floor", "Ceil",
    "Round", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Not", "Xor",
    "Mish", "PRelu", "ThresholdedRelu", "Sum", "Mean", "BitShift", "IsNaN", "IsInf", "Dropout",
})
_ONNX_REDUCTIONS = frozenset({
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp", "ArgMax", "ArgMin", "GlobalAveragePool",
    "GlobalMaxPool",
})
_ONNX_NORMS = frozenset({"LayerNormalization", "BatchNormalization", "GroupNormalization",
                         "InstanceNormalization"})


def onnx_fwd_flops(op_type: str, in_shapes: Sequence[Sequence[int] | None],
                   out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]) -> int:
    """Forward FLOPs of one ONNX op under the same conventions as the PyTorch side."""
    out_n = max((numel(s) for s in out_shapes), default=0)
    in_n = numel(in_shapes[0]) if in_shapes and in_shapes[0] is not None else 0
    if op_type == "MatMul":
        return 2 * out_n * int(in_shapes[0][-1])
    if op_type == "Gemm":
        k = in_shapes[0][0] if attrs.get("transA", 0) else in_shapes[0][-1]
        return 2 * out_n * int(k)
    if op_type == "Conv":
        w = in_shapes[1]
        return 2 * out_n * numel(w[1:])  # w: [C_out, C_in/groups, *kernel]
    if op_type == "ConvTranspose":
        w = in_shapes[1]  # [C_in, C_out/groups, *kernel]: every input element meets C_out/g * kernel weights
        return 2 * in_n * numel(w[1:])
    if op_type == "Attention":
        return _onnx_attention_flops(in_shapes, attrs)
    if op_type in _ONNX_POINTWISE:
        return out_n
    if op_type in _ONNX_REDUCTIONS:
        return in_n
    if op_type in ("Softmax", "LogSoftmax"):
        return SOFTMAX_FLOPS_PER_ELEMENT * out_n
    if op_type in _ONNX_NORMS:
        return NORM_FLOPS_PER_ELEMENT * in_n
    if op_type in ("RMSNormalization", "SimplifiedLayerNormalization"):
        return RMS_NORM_FLOPS_PER_ELEMENT * in_n
    return 0  # data movement, casts, shape ops, Einsum without a known contraction


def _onnx_attention_flops(in_shapes: Sequence[Sequence[int] | None], attrs: Mapping[str, Any]) -> int:
    """ONNX ``Attention`` (opset 23): Q ``[B, Hq, L, E]`` or ``[B, L, Hq*E]``; K/V likewise."""
    q, k, v = in_shapes[0], in_shapes[1], in_shapes[2]
    if len(q) == 4:
        b, hq, l_q, e = q
        s, e_v = k[2], v[3]
    else:
        hq = int(attrs.get("q_num_heads", 1))
        kvh = int(attrs.get("kv_num_heads", 1))
        b, l_q, e = q[0], q[1], q[2] // hq
        s, e_v = k[1], v[2] // kvh
    scores = b * hq * l_q * s
    return 2 * scores * e + 2 * scores * e_v + ATTN_SCORE_FLOPS_PER_ELEMENT * scores


def onnx_bwd_flops(op_type: str, fwd_flops: int, *, grad_inputs: Sequence[bool]) -> int:
    """Backward FLOPs of an ONNX op (no autograd here, so by rule, as documented above).

    Matmul-like: one forward's worth per operand that needs a gradient (the input
    gradient and the weight gradient are each a matmul of the forward's size).
    Everything else: about 1x forward when any operand needs a gradient.
    """
    if not any(grad_inputs):
        return 0
    if op_type in ("MatMul", "Gemm", "Conv", "ConvTranspose"):
        return fwd_flops * sum(1 for g in grad_inputs[:2] if g)
    if op_type == "Attention":
        return 2 * fwd_flops
    return fwd_flops


def onnx_bwd_input_flops(op_type: str, fwd_flops: int, *, grad_inputs: Sequence[bool],
                         weight_inputs: Sequence[bool]) -> int:
    """Of :func:`onnx_bwd_flops`, those for the gradients of the operands that are not ``weight_inputs``
    (parameters, or values computed from parameters alone): a matmul-like op's per such operand, the rest's where
    any such operand needs a gradient (module docstring)."""
    acts = [g and not w for g, w in zip(grad_inputs, list(weight_inputs) + [False] * len(grad_inputs))]
    if not any(acts):
        return 0
    if op_type in ("MatMul", "Gemm", "Conv", "ConvTranspose"):
        return fwd_flops * sum(1 for g in acts[:2] if g)
    return onnx_bwd_flops(op_type, fwd_flops, grad_inputs=grad_inputs)
