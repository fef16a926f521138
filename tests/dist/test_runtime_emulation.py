"""``--emulate-speed`` reaches the workers: the rank on the slower planned device pads its compute, the
other does not, also when both devices carry one type name (as profiles of one machine do)."""
from __future__ import annotations

from cost_models.devices import get_device_spec
from planner.plan import Plan
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.runtime.rank.metrics import read_metrics
from tests.dist.plans import make_plan


def test_slow_rank_pads_and_fast_rank_does_not(tmp_path):
    doc = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)]).to_dict()
    cpu = get_device_spec("CPU")
    slow = {**cpu.to_dict(), "peak_flops": {k: v / 3 for k, v in cpu.peak_flops},
            "mem_bw_bytes_per_s": cpu.mem_bw_bytes_per_s / 3}
    doc["cluster"]["hosts"][1]["devices"][0] = {"type": "CPU", "count": 1, "spec": slow}
    path = Plan.from_dict(doc).save(tmp_path / "plan.json")
    metrics = tmp_path / "metrics.jsonl"
    result = launch(RunOptions(plan=str(path), steps=3, timeout_s=60, emulate=True, metrics=str(metrics)))
    factors = {r["rank"]: (r["fwd_factor"], r["bwd_factor"]) for r in result["ranks"]}
    assert factors[0] == (1.0, 1.0)
    assert min(factors[1]) > 2.9
    rows = read_metrics(metrics)
    assert {r.rank for r in rows} == {0, 1} and len(rows) == 6
    assert all(r.pad_ms == 0.0 for r in rows if r.rank == 0)
    assert sum(r.pad_ms for r in rows if r.rank == 1) > 0.0
    assert all(r.compute_cpu_ms > 0.0 for r in rows)  # one torch thread: the passes' CPU time is measured
    assert result["emulated"] is True
