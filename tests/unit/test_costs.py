"""Pure cost functions (compute, comm, memory) against hand-computed values."""
from __future__ import annotations

import pytest

from cost_models.cluster import Link
from cost_models.cluster_file import parse_cluster
from cost_models.comm import allreduce_ms, group_allreduce_ms, ring_links, transfer_ms
from cost_models.compute import (
    block_bwd_ms,
    block_fwd_ms,
    block_times_ms,
    range_bwd_ms,
    range_fwd_ms,
    roofline_ms,
)
from cost_models.devices import DeviceSpec
from cost_models.memory import (
    MemoryBreakdown,
    bytes_per_param,
    in_flight_microbatches,
    stage_comm_buffer_bytes,
    stage_memory,
    stage_param_count,
    usable_memory_bytes,
)
from cost_models.training import TrainingConfig
from planner.errors import InvalidInputError
from planner.ir import Block, BlockChain, TiedParam

# 1 TFLOP/s fp32, 2 TFLOP/s bf16, 100 GB/s, efficiency 0.5 -> 0.5 TFLOP/s effective fp32.
SPEC = DeviceSpec(name="toy", peak_flops=(("float32", 1e12), ("bfloat16", 2e12)), mem_bytes=10 << 30,
                  mem_bw_bytes_per_s=100e9, efficiency=0.5)


def _block(i: int, *, fwd: int = 10**9, params: int = 1000, saved: int = 4000, out: int = 400,
           traffic: int = 0, nodes: int = 1) -> Block:
    return Block(index=i, name=f"b{i}", node_names=tuple(f"b{i}n{j}" for j in range(nodes)), module_paths=(),
                 param_names=(), fwd_flops=fwd, bwd_flops=2 * fwd, param_count=params, param_bytes=4 * params,
                 saved_act_bytes=saved, out_bytes=out, boundary_nodes=(), mem_traffic_bytes=traffic)


def _chain(n: int = 4, **kw) -> BlockChain:
    return BlockChain(model_name="toy", fingerprint="f", blocks=tuple(_block(i, **kw) for i in range(n)),
                      input_bytes=64, microbatch_size=2)


# --- compute ---------------------------------------------------------------
def test_compute_bound_block() -> None:
    b = _block(0, fwd=10**9, traffic=10**6)
    # 1e9 / (1e12 * 0.5) = 2 ms; memory 1e6 / 1e11 = 0.01 ms
    assert block_fwd_ms(b, SPEC) == pytest.approx(2.0)
    assert block_bwd_ms(b, SPEC) == pytest.approx(4.0)
    assert block_fwd_ms(b, SPEC, "bfloat16") == pytest.approx(1.0)


def test_memory_bound_block_and_dtype_traffic() -> None:
    b = _block(0, fwd=10**6, traffic=10**9)
    # memory: 1e9 / 1e11 = 10 ms; compute 1e6 / 5e11 = 0.002 ms
    assert block_fwd_ms(b, SPEC) == pytest.approx(10.0)
    assert block_bwd_ms(b, SPEC) == pytest.approx(20.0)  # twice the forward's traffic
    assert block_fwd_ms(b, SPEC, "bfloat16") == pytest.approx(5.0)  # half the bytes per element
    assert block_fwd_ms(b, SPEC, "bfloat16", trace_dtype="bfloat16") == pytest.approx(10.0)


def test_op_overhead() -> None:
    spec = DeviceSpec(name="t", peak_flops=(("float32", 1e12),), mem_bytes=1 << 30, mem_bw_bytes_per_s=1e11,
                      efficiency=0.5, op_overhead_ms=0.1)
    b = _block(0, fwd=10**9, nodes=3)
    assert block_fwd_ms(b, spec) == pytest.approx(2.0 + 0.3)
    assert block_bwd_ms(b, spec) == pytest.approx(4.0 + 1.2 * 0.3)  # backward runs 1.2x the ops
    assert roofline_ms(0, 0, 5, spec, "float32") == pytest.approx(0.5)
    with pytest.raises(InvalidInputError):
        roofline_ms(-1, 0, 0, spec, "float32")


def test_ranges_sum_blocks_inclusive() -> None:
    chain = _chain(4)
    assert range_fwd_ms(chain, 1, 2, SPEC) == pytest.approx(4.0)
    assert range_bwd_ms(chain, 0, 3, SPEC) == pytest.approx(16.0)
    assert block_times_ms(chain, SPEC) == tuple((pytest.approx(2.0), pytest.approx(4.0)) for _ in range(4))
    with pytest.raises(InvalidInputError, match="block range"):
        range_fwd_ms(chain, 2, 4, SPEC)
    with pytest.raises(InvalidInputError, match="block range"):
        range_fwd_ms(chain, 2, 1, SPEC)


# --- comm ------------------------------------------------------------------
def test_transfer_ms() -> None:
    link = Link(bandwidth_gbps=8.0, latency_ms=2.0)  # 1e9 bytes/s
    assert transfer_ms(10**6, link) == pytest.approx(2.0 + 1.0)
    assert transfer_ms(0, link) == 0.0
    with pytest.raises(InvalidInputError):
        transfer_ms(-1, link)


def test_allreduce_ring_formula() -> None:
    fast = Link(bandwidth_gbps=80.0, latency_ms=0.1)  # 1e10 B/s
    slow = Link(bandwidth_gbps=8.0, latency_ms=1.0)  # 1e9 B/s
    # r=4: 2*3/4 * 1e8 / 1e9 s = 150 ms, + 2*3*1.0 ms latency (the largest) = 156 ms
    assert allreduce_ms(10**8, (fast, fast, slow, fast), 4) == pytest.approx(156.0)
    # r=2: 2*1/2 * 1e8 / 1e10 s = 10 ms + 2 * 0.1 = 10.2 ms
    assert allreduce_ms(10**8, (fast, fast), 2) == pytest.approx(10.2)
    assert allreduce_ms(10**8, (), 1) == 0.0
    with pytest.raises(InvalidInputError):
        allreduce_ms(10**8, (), 2)


def test_group_allreduce_on_a_cluster() -> None:
    c = parse_cluster({
        "name": "c",
        "hosts": [{"name": "a", "region": "r1", "trust": "t", "devices": [{"type": "T4", "count": 2}]},
                  {"name": "b", "region": "r2", "trust": "t", "devices": [{"type": "T4"}]}],
        "links": {"intra_host": {"bandwidth_gbps": 80, "latency_ms": 0},
                  "default": {"bandwidth_gbps": 8, "latency_ms": 5}}})
    ids = ("a/0", "a/1", "b/0")
    assert ring_links(c, ids) == (c.intra_host, c.default, c.default)
    # 2*2/3 * 3e6 B / 1e9 B/s = 4 ms + 2*2*5 ms = 24 ms
    assert group_allreduce_ms(c, ids, 3 * 10**6) == pytest.approx(24.0)
    assert group_allreduce_ms(c, ("a/0",), 10**9) == 0.0


# --- memory ----------------------------------------------------------------
@pytest.mark.parametrize("optimizer,dtype,mixed,momentum,expected", [
    ("adam", "float32", False, False, (4, 4, 8)),
    ("adam", "bfloat16", True, False, (2, 2, 12)),  # fp32 master + two fp32 moments
    ("adam", "bfloat16", False, False, (2, 2, 4)),
    ("adam", "float32", True, False, (4, 4, 8)),  # no master copy at fp32
    ("sgd", "float32", False, False, (4, 4, 0)),
    ("sgd", "float32", False, True, (4, 4, 4)),
    ("sgd", "float16", True, True, (2, 2, 8)),
])
def test_bytes_per_param(optimizer, dtype, mixed, momentum, expected) -> None:
    cfg = TrainingConfig(global_batch=8, microbatch_size=2, optimizer=optimizer, dtype=dtype, mixed_precision=mixed)
    per = bytes_per_param(cfg, sgd_momentum=momentum)
    assert (per.weights, per.grads, per.optimizer) == expected
    if optimizer == "adam" and (mixed or dtype == "float32"):
        assert per.total == 16


def test_in_flight_microbatches() -> None:
    assert in_flight_microbatches("gpipe", 4, 3, 8) == 8
    assert [in_flight_microbatches("1f1b", 4, k, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("1f1b", 4, k, 2) for k in range(4)] == [2, 2, 2, 1]
    for bad in (("pipedream", 4, 0, 8), ("1f1b", 4, 4, 8), ("1f1b", 0, 0, 8), ("gpipe", 2, 0, 0)):
        with pytest.raises(InvalidInputError):
            in_flight_microbatches(*bad)


def test_stage_memory_hand_computed() -> None:
    chain = _chain(4)  # 1000 params, 4000 saved bytes, 400 out bytes per block; traced at mb=2, fp32
    cfg = TrainingConfig(global_batch=8, microbatch_size=2, optimizer="adam")
    mem = stage_memory(chain, 1, 2, cfg, in_flight_mb=3)
    # middle stage: in act 400 + in grad 400 + out act 400 + out grad 400
    assert mem == MemoryBreakdown(weights_bytes=8000, grads_bytes=8000, optimizer_bytes=16000,
                                  activations_bytes=8000 * 3, buffers_bytes=1600)
    assert mem.total_bytes == 8000 + 8000 + 16000 + 24000 + 1600
    assert mem.static_bytes == 32000
    # first stage receives the input (64 B) and sends no gradient back; last sends nothing on
    assert stage_comm_buffer_bytes(chain, 0, 1, cfg) == 64 + 400 + 400
    assert stage_comm_buffer_bytes(chain, 2, 3, cfg) == 400 + 400
    assert stage_memory(chain, 0, 3, cfg, 1, comm_buffer_bytes=0).buffers_bytes == 0


def test_stage_memory_scales_activations_to_config() -> None:
    chain = _chain(2)
    cfg = TrainingConfig(global_batch=16, microbatch_size=4, optimizer="sgd", dtype="bfloat16",
                         mixed_precision=True)
    mem = stage_memory(chain, 0, 1, cfg, 2)
    # activations: 2 blocks x 4000 B x (4/2 microbatch) x (2/4 bytes) x 2 in flight
    assert mem.activations_bytes == 16000
    assert (mem.weights_bytes, mem.grads_bytes, mem.optimizer_bytes) == (4000, 4000, 8000)
    with pytest.raises(InvalidInputError):
        stage_memory(chain, 0, 1, cfg, 0)


def test_tied_parameter_copy_on_a_later_stage() -> None:
    base = _chain(4)
    chain = BlockChain(model_name="t", fingerprint="f", blocks=base.blocks, input_bytes=64, microbatch_size=2,
                       tied_params=(TiedParam(name="wte", blocks=(0, 3), nbytes=4 * 500),))
    assert stage_param_count(chain, 0, 3) == 4000  # counted once, in block 0
    assert stage_param_count(chain, 0, 1) == 2000
    assert stage_param_count(chain, 2, 3) == 2000 + 500  # the head stage keeps its own copy


def test_usable_memory() -> None:
    assert usable_memory_bytes(SPEC) == int(0.9 * (10 << 30))
