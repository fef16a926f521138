"""planner.meta_twin swaps a model's tensors for meta ones and restores them (tied ones stay tied);
planner.train refuses a module it cannot hand to the ranks and data that is not token ids, before any run."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.errors import InvalidInputError
from planner.meta_twin import on_meta
from planner.driver import _data_spec, _with_saved_model


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    return model


def test_on_meta_swaps_and_restores():
    model = _tied()
    before = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    with on_meta(model, (torch.zeros(2, 3, dtype=torch.long), 5)) as (ids, other):
        assert ids.device.type == "meta" and other == 5
        assert all(p.device.type == "meta" for p in model.parameters())
        assert model[1].weight is model[0].weight
        assert model(ids).shape == (2, 3, 8)
    after = model.state_dict(keep_vars=True)
    assert all(after[name] is t for name, t in before.items())


def test_on_meta_restores_after_an_error():
    model = _tied()
    weight = model[0].weight
    with pytest.raises(RuntimeError), on_meta(model, ()):
        raise RuntimeError("inside")
    assert model[0].weight is weight and weight.device.type == "cpu"


def test_train_refuses_a_module_that_is_not_a_transformers_model(tmp_path):
    with pytest.raises(InvalidInputError, match="PreTrainedModel"):
        _with_saved_model(None, _tied(), tmp_path)  # type: ignore[arg-type]


def test_train_data_is_a_spec_or_flat_token_ids(tmp_path):
    assert _data_spec("synthetic", tmp_path / "t.npy") == "synthetic"
    assert _data_spec(torch.arange(10), tmp_path / "t.npy") == f"tokens:{tmp_path / 't.npy'}"
    with pytest.raises(InvalidInputError, match="flat array"):
        _data_spec(torch.zeros(2, 3, dtype=torch.long), tmp_path / "u.npy")
    with pytest.raises(InvalidInputError, match="flat array"):
        _data_spec([0.5, 1.5], tmp_path / "v.npy")
