"""The executor probe end to end: a 2-stage plan of a tiny model on the real runtime (two gloo processes, one
thread each), measured by the profile's own entry point (a subprocess), priced into a MessageCost."""
from __future__ import annotations

from cost_models.measured import MessageCost, with_executor_cost
from planner.profiling.probes import measure_executor


def test_the_probe_runs_a_tiny_plan_and_reports_positive_executor_cpu():
    report = measure_executor(model="gpt-tiny", batch=2, seq=16, steps=3, timeout_s=90)
    assert report["messages"] == 16 and report["passes"] == 16  # 4 microbatches: 2 x 4 each way, 2 x 8 passes
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["message_bytes"] > 0
    assert report["comm_cpu_per_message_ms"] > 0 and report["bookkeeping_per_pass_ms"] > 0
    assert report["backend_cpu_per_message_ms"] >= 0
    for rank in report["ranks"]:
        # the executor's own CPU holds its posting, and the thread's CPU holds both and the passes
        assert 0 < rank["comm_cpu_ms"] <= rank["own_cpu_ms"] < rank["thread_cpu_ms"]
    cost = with_executor_cost(MessageCost(send_ms=0.0, recv_ms=0.0), report)
    assert cost.executor_ms > 0 and cost.executor_pass_ms == report["bookkeeping_per_pass_ms"]
