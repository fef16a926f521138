"""A rank's checkpoint file: parameters, optimizer state and its extra state, by parameter name."""
from __future__ import annotations

import torch

from planner.runtime import checkpoint


def test_a_rank_file_round_trips_parameters_optimizer_state_and_extra_state(tmp_path):
    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    checkpoint.save_rank(tmp_path, step=4, rank=0, fingerprint="f", params={"layer.w": w}, optimizer=opt,
                         state={"bans": {"banned": [2]}})
    checkpoint.complete(tmp_path, step=4, num_ranks=1, fingerprint="f")
    assert checkpoint.latest(tmp_path, fingerprint="f") == 4
    fresh = torch.nn.Parameter(torch.zeros(3, 2))
    opt2 = torch.optim.Adam([fresh], lr=0.1)
    got = checkpoint.restore_rank(tmp_path, step=4, params={"layer.w": fresh}, optimizer=opt2, rank=0)
    torch.testing.assert_close(fresh.detach(), w.detach())
    torch.testing.assert_close(opt2.state[fresh]["exp_avg"], opt.state[w]["exp_avg"])
    assert got.state == {"bans": {"banned": [2]}}
