"""Byte-level stdlib text and synthetic batches: deterministic, in range, learnable."""
from __future__ import annotations

import pytest
import torch

from models.data import ByteTextDataset, make_batch, stdlib_sources, synthetic_batch
from models.registry import build_model, loss_fn
from planner.errors import InvalidInputError

torch.set_num_threads(1)
SMALL = 300_000  # bytes: enough text for the tests, quick to read


def test_text_batches_are_deterministic_in_step_and_seed():
    a, b = ByteTextDataset(32, max_bytes=SMALL), ByteTextDataset(32, max_bytes=SMALL)
    assert a.fingerprint() == b.fingerprint()
    x, y = a.batch(step=7, batch=4, seed=1)
    x2, y2 = b.batch(step=7, batch=4, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(a.batch(step=8, batch=4, seed=1)[0], x)
    assert not torch.equal(a.batch(step=7, batch=4, seed=2)[0], x)


def test_text_batch_shapes_vocab_and_shift():
    ds = ByteTextDataset(48, max_bytes=SMALL)
    x, y = ds.batch(step=0, batch=6)
    assert x.shape == y.shape == (6, 48) and x.dtype == y.dtype == torch.long
    assert 0 <= int(x.min()) and int(x.max()) < ByteTextDataset.vocab_size == 256
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    assert b"def " in ds.data.numpy().tobytes()  # it really is Python source


def test_splits_are_disjoint_files_and_sized_by_max_bytes():
    train, val = ByteTextDataset(16, "train", SMALL), ByteTextDataset(16, "val", SMALL)
    assert train.num_bytes + val.num_bytes == SMALL
    assert 0 < val.num_bytes < train.num_bytes
    assert train.fingerprint() != val.fingerprint()
    files = stdlib_sources(SMALL)
    assert len(files) >= 2 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in stdlib_sources())


@pytest.mark.parametrize(("args", "needle"), [
    ((0,), "seq_len"), ((8, "test"), "'train' or 'val'"), ((8, "train", 0), "max_bytes"),
    ((5000, "val", 20_000), "raise max_bytes or lower seq_len"),
])
def test_bad_dataset_arguments(args, needle):
    with pytest.raises(InvalidInputError, match=needle):
        ByteTextDataset(*args)


def test_bad_batch_arguments():
    with pytest.raises(InvalidInputError):
        ByteTextDataset(8, max_bytes=SMALL).batch(step=-1, batch=2)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mlp-tiny", "cnn-tiny"])
def test_synthetic_batches_match_example_inputs_and_are_deterministic(name):
    bundle = build_model(name, batch=1)  # meta: synthetic data needs only shapes
    (x,), y = synthetic_batch(bundle, step=3, batch=5, seed=0)
    (x2,), y2 = make_batch(bundle, 5, 0, step=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == (5, *bundle.example_inputs[0].shape[1:]) and x.dtype == bundle.example_inputs[0].dtype
    assert not torch.equal(synthetic_batch(bundle, step=4, batch=5, seed=0)[0][0], x)
    assert int(y.min()) >= 0 and int(y.max()) < bundle.vocab_or_classes
    if bundle.family == "lm":
        assert y.shape == x.shape
        torch.testing.assert_close(y, (5 * x + 3) % bundle.vocab_or_classes)  # the learnable rule
    else:
        assert y.shape == (5,)


@pytest.mark.parametrize("name", ["mlp-tiny", "cnn-tiny"])
def test_synthetic_classification_is_learnable(name):
    bundle = build_model(name, device="cpu", seed=0)
    model, loss = bundle.module, loss_fn(bundle)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    (x_val,), y_val = make_batch(bundle, 64, seed=99)
    with torch.no_grad():
        before = loss(model(x_val), y_val).item()
    for step in range(30):
        (x,), y = make_batch(bundle, 32, seed=0, step=step)
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        after = loss(model(x_val), y_val).item()
    assert after < 0.7 * before
