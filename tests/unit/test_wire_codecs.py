"""Boundary codecs on the wire: the round trip stays within the priced error, the payload's bytes are the
priced bytes, ``none`` is exact, and non-finite values never decode to finite numbers."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.codecs import BLOCK, REL_ERROR, wire_bytes
from planner.runtime.wire.codecs import decode, encode, payload_bytes, payload_specs

LOSSY = ("fp8", "int8", "int4")
shapes = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=3).map(tuple)


def _round_trip(x: torch.Tensor, codec: str, direction: str) -> torch.Tensor:
    payloads = encode(x, codec, direction)
    assert [(tuple(p.shape), p.dtype) for p in payloads] == payload_specs(x.shape, x.dtype, codec)
    return decode([p.clone() for p in payloads], codec, x.shape, x.dtype, direction)


def _absmax(x: torch.Tensor, codec: str) -> torch.Tensor:
    """The absmax of each value's block, per value."""
    flat = x.reshape(-1).float()
    block = BLOCK[codec]
    pad = torch.nn.functional.pad(flat.abs(), (0, (-flat.numel()) % block)).reshape(-1, block)
    return pad.amax(dim=1, keepdim=True).expand_as(pad).reshape(-1)[:flat.numel()]


@settings(max_examples=40, deadline=None)
@given(shape=shapes, codec=st.sampled_from(LOSSY), direction=st.sampled_from("FB"),
       log_scale=st.floats(min_value=-20, max_value=20), seed=st.integers(0, 2 ** 16))
def test_round_trip_error_within_the_priced_bound(shape, codec, direction, log_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * math.exp(log_scale)
    y = _round_trip(x, codec, direction)
    assert y.shape == x.shape and y.dtype == x.dtype
    err, absmax = (y - x).abs().reshape(-1), _absmax(x, codec)
    # beyond the bound, a few fp32 roundings of the absmax (scale, divide, rescale) and no more
    excess = err - (REL_ERROR[codec] + 1e-6) * absmax
    assert bool((excess <= 0).all()), float(excess.max())


@settings(max_examples=40, deadline=None)
@given(shape=shapes, codec=st.sampled_from(LOSSY), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                          torch.float16]))
def test_payload_bytes_are_the_priced_wire_bytes(shape, codec, dtype):
    x = torch.randn(shape).to(dtype)
    elem = x.element_size()
    assert payload_bytes(encode(x, codec, "F")) == wire_bytes(codec, x.numel() * elem, elem)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_none_and_integer_tensors_travel_as_they_are(dtype):
    x = (torch.randn(5, 7) * 100).to(dtype)
    for codec in ("none",) + (LOSSY if dtype == torch.int64 else ()):
        payloads = encode(x, codec, "F")
        assert payloads == [x] or torch.equal(payloads[0], x)
        assert torch.equal(decode(payloads, codec, x.shape, x.dtype, "F"), x)
        assert payload_bytes(payloads) == wire_bytes("none", x.numel() * x.element_size(), x.element_size())


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_values_decode_non_finite(codec, bad):
    x = torch.randn(3 * 128 + 5)
    x[130] = bad  # in fp8's and int8's second block, int4's ninth
    y = _round_trip(x, codec, "B")
    assert not torch.isfinite(y[130])
    # the poisoned block is NaN throughout; the others decode as ever
    lo, hi = 130 // BLOCK[codec] * BLOCK[codec], (130 // BLOCK[codec] + 1) * BLOCK[codec]
    assert torch.isnan(y[lo:hi]).all()
    rest = torch.cat([y[:lo], y[hi:]])
    assert torch.isfinite(rest).all()


@pytest.mark.parametrize("codec", LOSSY)
def test_zeros_and_fp8_ranges(codec):
    z = torch.zeros(200)
    assert torch.equal(_round_trip(z, codec, "F"), z)
    # a gradient far beyond e4m3's range survives: the per-block scale keeps it in range
    g = torch.randn(64) * 1e6
    assert torch.isfinite(_round_trip(g, codec, "B")).all()


def test_fp8_directions_use_their_formats():
    x = torch.linspace(-1, 1, 33)
    f, b = encode(x, "fp8", "F")[0], encode(x, "fp8", "B")[0]
    assert not torch.equal(f, b)  # e4m3 and e5m2 codes differ
    assert (_round_trip(x, "fp8", "F") - x).abs().max() <= (_round_trip(x, "fp8", "B") - x).abs().max()
