"""The same plan runs as two "hosts": two `torchrun --nnodes 2` invocations on 127.0.0.1 with a c10d
rendezvous, through `python -m planner.runtime`, and trains exactly like the unpipelined reference
(which the local launcher is tested to match too)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from planner.runtime.launch import free_port
from tests.dist.plans import load_dumps, make_plan, reference_run

STEPS = 2


def test_two_torchrun_nodes_match_the_reference(tmp_path):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=4, seq=16, stages=[(0, 2), (3, 5)],
                     schedule="1f1b", optimizer="adam")
    path = plan.save(tmp_path / "plan.json")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("STAGEWISE_EVENTS", None)
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "stagewise-test", "--max-restarts", "0",
               "-m", "planner.runtime", str(path), "--steps", str(STEPS), "--timeout", "60",
               "--dump", str(tmp_path / "dump")]
        nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    for p, out in zip(nodes, outputs):
        assert p.returncode == 0, out[-3000:]
    text = "\n".join(outputs)
    assert re.search(r"predicted [\d.]+ ms/step .* measured [\d.]+ ms/step", text), text[-2000:]

    losses, grads, params = reference_run(plan, steps=STEPS)
    printed = [float(x) for x in re.findall(r"step \d+/\d+\s+loss ([\d.]+)", text)]
    assert len(printed) == STEPS
    torch.testing.assert_close(torch.tensor(printed), torch.tensor(losses), rtol=1e-4, atol=1e-4)
    for d in load_dumps(tmp_path / "dump", plan.num_ranks):
        for name, g in d["grads"].items():
            torch.testing.assert_close(g, grads[name], rtol=1e-4, atol=1e-6)
        for name, p in d["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-4, atol=1e-5)
