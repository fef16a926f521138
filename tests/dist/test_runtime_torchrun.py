"""The same plan runs as two "hosts": two `torchrun --nnodes 2` invocations on loopback with a c10d
rendezvous, through `python -m planner.runtime`, and trains exactly like the unpipelined reference
(which the local launcher is tested to match too). Each host is named (`--host`): c10d orders the
nodes by address, not by `--node-rank`, and here it puts h1 first, yet every host runs the plan's
ranks for it. A host name the plan does not have is refused before the rendezvous."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from planner.runtime.launcher.launch import free_port
from tests.dist.plans import load_dumps, make_plan, reference_run

STEPS = 2


def _torchrun(path, *, nnodes: int, nproc: int, port: int, args: list[str], local_addr: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("STAGEWISE_EVENTS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stagewise-test",
           "--max-restarts", "0", "--local-addr", local_addr, "-m", "planner.runtime", str(path), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_torchrun_hosts_in_swapped_node_order_run_the_plans_layout(tmp_path):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=4, seq=16, stages=[(0, 2), (3, 5)],
                     schedule="1f1b", optimizer="adam")
    path = plan.save(tmp_path / "plan.json")
    assert [r.host for r in plan.ranks] == ["h0", "h1"]
    port = free_port()
    run = ["--steps", str(STEPS), "--timeout", "60", "--dump", str(tmp_path / "dump")]
    # c10d sorts nodes by address: h1's node (127.0.0.1) becomes torchrun's node 0, h0's (127.0.0.2) node 1
    nodes = {host: _torchrun(path, nnodes=2, nproc=1, port=port, args=[*run, "--host", host], local_addr=addr)
             for host, addr in (("h1", "127.0.0.1"), ("h0", "127.0.0.2"))}
    outputs = {host: p.communicate(timeout=300)[0] for host, p in nodes.items()}
    for host, p in nodes.items():
        assert p.returncode == 0, outputs[host][-3000:]
    assert "host 'h1': launcher rank 0 runs the plan's rank 1" in outputs["h1"], outputs["h1"][-2000:]
    assert "host 'h0': launcher rank 1 runs the plan's rank 0" in outputs["h0"], outputs["h0"][-2000:]
    # the plan's rank 0 (first stage, the progress lines) ran on h0
    assert re.search(r"predicted [\d.]+ ms/step .* measured [\d.]+ ms/step", outputs["h0"]), outputs["h0"][-2000:]
    assert "loss" not in outputs["h1"]

    losses, grads, params = reference_run(plan, steps=STEPS)
    printed = [float(x) for x in re.findall(r"step \d+/\d+\s+loss ([\d.]+)", outputs["h0"])]
    assert len(printed) == STEPS
    torch.testing.assert_close(torch.tensor(printed), torch.tensor(losses), rtol=1e-4, atol=1e-4)
    for d in load_dumps(tmp_path / "dump", plan.num_ranks):
        for name, g in d["grads"].items():
            torch.testing.assert_close(g, grads[name], rtol=1e-4, atol=1e-6)
        for name, p in d["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-4, atol=1e-5)


def test_a_host_name_the_plan_does_not_have_is_refused(tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    path = plan.save(tmp_path / "plan.json")
    node = _torchrun(path, nnodes=1, nproc=2, port=free_port(), args=["--steps", "1", "--host", "intruder"],
                     local_addr="127.0.0.1")
    out = node.communicate(timeout=120)[0]
    assert node.returncode != 0
    assert "error: host 'intruder'; expected one of the plan's hosts (h0, h1)" in out, out[-2000:]
