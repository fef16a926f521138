"""Boundary codecs' rounding and price: int4's backward gradients round stochastically (unbiased, within a whole
step, the same bytes for the same tensor), everything else to nearest (within half a step); fp8 scales per block;
every direction's payload is the priced wire bytes; a CPU's encode/decode is priced per call and per byte."""
from __future__ import annotations

import pytest
import torch

from cost_models.codecs import (
    BLOCK,
    CPU_FIT,
    PASSES,
    REL_ERROR,
    STOCHASTIC,
    codec_ms,
    rel_error,
    wire_bytes,
)
from planner.runtime.wire.codecs import decode, encode, payload_bytes

LOSSY = ("fp8", "int8", "int4")


def _round_trip(x: torch.Tensor, codec: str, direction: str) -> torch.Tensor:
    return decode(encode(x, codec, direction), codec, x.shape, x.dtype, direction)


def _block_absmax(x: torch.Tensor, codec: str) -> torch.Tensor:
    block = BLOCK[codec]
    pad = torch.nn.functional.pad(x.abs(), (0, (-x.numel()) % block)).reshape(-1, block)
    return pad.amax(dim=1, keepdim=True).expand_as(pad).reshape(-1)[:x.numel()]


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("direction", ["F", "B"])
def test_each_direction_within_its_bound_and_the_codecs_bound(codec, direction):
    x = torch.randn(4000, generator=torch.Generator().manual_seed(1)) ** 3  # heavy tails, like gradients
    err = (_round_trip(x, codec, direction) - x).abs()
    bound = rel_error(codec, direction)
    assert bound <= REL_ERROR[codec]
    assert bool((err <= (bound + 1e-6) * _block_absmax(x, codec)).all())


def test_int4_backward_rounds_stochastically_and_without_bias():
    # one large value fixes each block's step at 1.0; the rest sit 0.3 of a step above zero
    x = torch.full((2000, BLOCK["int4"]), 0.3)
    x[:, 0] = 7.0
    forward, backward = _round_trip(x.reshape(-1), "int4", "F"), _round_trip(x.reshape(-1), "int4", "B")
    small_f, small_b = forward.reshape(x.shape)[:, 1:], backward.reshape(x.shape)[:, 1:]
    assert torch.equal(small_f, torch.zeros_like(small_f))           # to nearest: the 0.3 vanishes, every time
    assert set(small_b.unique().tolist()) == {0.0, 1.0}               # stochastic: 0 or 1 step
    assert abs(float(small_b.mean()) - 0.3) < 0.01                    # and 0.3 on average (62,000 values)
    assert ("int4", "B") in STOCHASTIC and rel_error("int4", "B") == 2 * rel_error("int4", "F")


def test_stochastic_rounding_is_a_function_of_the_tensor():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    first, again = encode(x, "int4", "B")[0], encode(x.clone(), "int4", "B")[0]
    assert torch.equal(first, again)  # a verifier's copy, and a twin's send, carry the consumer's bytes
    shifted = encode(torch.roll(x, 1, dims=1), "int4", "B")[0]
    assert not torch.equal(first, shifted)


def test_fp8_scales_per_block_so_an_outlier_spares_the_other_blocks():
    x = torch.randn(2 * BLOCK["fp8"], generator=torch.Generator().manual_seed(3)) * 1e-3
    x[0] = 1e4  # per tensor, the second block would sit deep in e4m3's subnormals
    y = _round_trip(x, "fp8", "F")
    rest, got = x[BLOCK["fp8"]:], y[BLOCK["fp8"]:]
    assert float(((got - rest).abs() / rest.abs()).max()) <= 2.0 ** -4 + 1e-6  # e4m3: half an ulp, relative


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("direction", ["F", "B"])
@pytest.mark.parametrize("n", [1, 31, 33, 128, 1001])
def test_payload_bytes_are_the_priced_wire_bytes_both_ways(codec, direction, n):
    x = torch.randn(n)
    assert payload_bytes(encode(x, codec, direction)) == wire_bytes(codec, 4.0 * n, 4)


def test_gpus_price_passes_at_bandwidth_and_cpus_add_a_fixed_cost_per_call():
    bw, nbytes = 1e12, 4e6
    for codec in LOSSY:
        for op in ("encode", "decode"):
            gpu = codec_ms(codec, nbytes, bw, op)
            assert gpu == pytest.approx(1e3 * PASSES[op] * 2 * nbytes / bw)
            cpu_small = codec_ms(codec, 4.0, 32e9, op, op_overhead_ms=0.03, kind="cpu")
            assert cpu_small == pytest.approx(0.03 * CPU_FIT[(codec, "F", op)][0], rel=1e-3)  # a call, not its bytes
            cpu = codec_ms(codec, nbytes, 32e9, op, op_overhead_ms=0.03, kind="cpu")
            assert cpu > cpu_small
    # int4's stochastic encode hashes every value: dearer than its round to nearest
    assert codec_ms("int4", nbytes, 32e9, "encode", op_overhead_ms=0.03, kind="cpu", direction="B") > \
        codec_ms("int4", nbytes, 32e9, "encode", op_overhead_ms=0.03, kind="cpu", direction="F")
    assert codec_ms("none", nbytes, 32e9, "encode", op_overhead_ms=0.03, kind="cpu") == 0.0
