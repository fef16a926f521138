"""Two "hosts" on loopback without torchrun: each starts its rank with `python -m planner.runtime PLAN
--host NAME --store 127.0.0.1:PORT`; the plan's rank 0 serves the run's own store on that address alone
(no pickle channel, unlike c10d's dynamic rendezvous). They train like the unpipelined reference; a host
holding another secret is refused and the run does not start."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from planner.runtime.launcher.launch import free_port
from tests.dist.plans import load_dumps, make_plan, reference_run

STEPS = 2


def _host(path, host: str, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOCAL_RANK": "0"}
    for name in ("RANK", "WORLD_SIZE", "STAGEWISE_EVENTS", "STAGEWISE_LOCAL_RUN"):
        env.pop(name, None)
    cmd = [sys.executable, "-P", "-m", "planner.runtime", str(path), "--host", host, "--store", f"127.0.0.1:{port}",
           *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_hosts_meet_at_the_runs_own_store_and_train_like_the_reference(tmp_path):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=4, seq=16, stages=[(0, 2), (3, 5)], optimizer="adam")
    path = plan.save(tmp_path / "plan.json")
    port = free_port()
    run = ["--steps", str(STEPS), "--timeout", "60", "--dump", str(tmp_path / "dump")]
    hosts = {h: _host(path, h, port, *run) for h in ("h1", "h0")}
    outputs = {h: p.communicate(timeout=300)[0] for h, p in hosts.items()}
    for h, p in hosts.items():
        assert p.returncode == 0, outputs[h][-3000:]
    assert "host 'h1' runs the plan's rank 1" in outputs["h1"]
    _, _, params = reference_run(plan, steps=STEPS)
    for d in load_dumps(tmp_path / "dump", plan.num_ranks):
        for name, p in d["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-4, atol=1e-5)


def test_a_host_with_another_secret_is_refused_and_the_run_does_not_start(tmp_path):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)])
    path = plan.save(tmp_path / "plan.json")
    other = tmp_path / "other-secret"
    other.write_text("f" * 64 + "\n")
    other.chmod(0o600)
    port = free_port()
    good = _host(path, "h0", port, "--steps", "2", "--timeout", "10")
    bad = _host(path, "h1", port, "--steps", "2", "--timeout", "10", "--secret-file", str(other))
    bad_out = bad.communicate(timeout=120)[0]
    good_out = good.communicate(timeout=120)[0]
    assert bad.returncode == 2 and "does not match its signature" in bad_out, bad_out[-2000:]
    assert "Traceback" not in bad_out
    assert good.returncode != 0 and "rank" in good_out, good_out[-2000:]
    assert "loss" not in good_out  # nothing trained
