"""Batches for a plan (planner.runtime.data): identical on every rank, sliced into microbatches."""
from __future__ import annotations

import pytest
import torch

from models.registry import build_model
from planner.errors import InvalidInputError
from planner.runtime.data import (
    PlanBatches,
    SyntheticSource,
    TextSource,
    make_source,
    resolve_loss,
)


def test_byte_level_lm_gets_text_and_classifier_gets_synthetic():
    lm = build_model("gpt-tiny", batch=2, seq=16, device="meta")
    mlp = build_model("mlp-tiny", batch=2, device="meta")
    assert isinstance(make_source(lm, seq=16), TextSource)
    assert isinstance(make_source(mlp), SyntheticSource)
    with pytest.raises(InvalidInputError, match="synthetic"):
        make_source(mlp, kind="text")
    with pytest.raises(InvalidInputError):
        make_source(mlp, kind="nonsense")


def test_microbatches_tile_the_global_batch_and_are_reproducible():
    lm = build_model("gpt-tiny", batch=2, seq=16, device="meta")
    a = PlanBatches(make_source(lm, seq=16, seed=4), global_batch=6, microbatch_size=2)
    b = PlanBatches(make_source(lm, seq=16, seed=4), global_batch=6, microbatch_size=2)
    (x, ), y = a.global_step_batch(3)
    assert x.shape == (6, 16) and y.shape == (6, 16)
    for mb in range(3):
        (xm,), ym = b.microbatch(3, mb)
        torch.testing.assert_close(xm, x[2 * mb:2 * mb + 2])
        torch.testing.assert_close(ym, y[2 * mb:2 * mb + 2])
    torch.testing.assert_close(y[:, :-1], x[:, 1:])  # next-byte targets
    assert not torch.equal(a.global_step_batch(4)[1], y)


def test_data_and_loss_hooks_are_imported_by_name():
    bundle = build_model("mlp-tiny", batch=2, device="meta")
    src = make_source(bundle, kind="tests.unit.test_runtime_data:constant_source")
    (x,), y = src.batch(0, 4)
    assert x.shape == (4, 32) and y.tolist() == [1, 1, 1, 1]
    loss = resolve_loss(bundle, "tests.unit.test_runtime_data:l1_loss")
    assert loss.__name__ == "l1_loss" and float(loss(-torch.ones(2, 3), None)) == 1.0
    with pytest.raises(InvalidInputError):
        make_source(bundle, kind="tests.unit.test_runtime_data:missing")


class _Constant:
    def batch(self, step: int, size: int):
        return (torch.ones(size, 32),), torch.ones(size, dtype=torch.long)


def constant_source(bundle, seed):
    return _Constant()


def l1_loss(logits, targets):
    return logits.abs().mean()
