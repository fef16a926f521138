"""`--data text:FILE` and `--data tokens:FILE`: the spec grammar, every bad file as one clear error,
deterministic batches per (step, microbatch), and token ids bounded by the model's vocabulary."""
from __future__ import annotations

import pickle
import re
import sys

import numpy as np
import pytest
import torch

from models.gpt import GPT, GPTConfig
from models.registry import build_model
from planner.errors import InvalidInputError
from planner.runtime.data import (
    DataSpec,
    FileSource,
    PlanBatches,
    SyntheticSource,
    TextSource,
    check_data,
    check_data_file,
    make_source,
    parse_data_spec,
)

SEQ = 16


@pytest.fixture(scope="module")
def lm():
    return build_model("gpt-tiny", batch=2, seq=SEQ, device="meta")  # vocab 256


def small_vocab_gpt():
    """A language model whose vocabulary (100) cannot hold every byte value."""
    return GPT(GPTConfig(vocab_size=100, max_seq=SEQ, n_layers=1, d_model=16, n_heads=2))


def _ids(n: int, vocab: int = 256) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7 + 3) % vocab


def _error(bundle, spec: str) -> str:
    with pytest.raises(InvalidInputError) as info:
        make_source(bundle, kind=spec, seq=SEQ)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- grammar
@pytest.mark.parametrize("spec, parsed", [
    ("auto", DataSpec(kind="auto")),
    ("text", DataSpec(kind="text")),
    ("synthetic", DataSpec(kind="synthetic")),
    ("text:corpus.txt", DataSpec(kind="text-file", target="corpus.txt")),
    ("tokens:/data/train.bin", DataSpec(kind="tokens-file", target="/data/train.bin")),
    ("tokens:C:x.npy", DataSpec(kind="tokens-file", target="C:x.npy")),   # only the first colon separates
    ("tests.unit.test_runtime_data:constant_source",
     DataSpec(kind="factory", target="tests.unit.test_runtime_data:constant_source")),
    ("text.sub:fn", DataSpec(kind="factory", target="text.sub:fn")),  # a package text.sub is still a module
])
def test_specs_parse_one_way(spec, parsed):
    assert parse_data_spec(spec) == parsed


@pytest.mark.parametrize("spec, says", [("nonsense", "tokens:FILE"), ("text:", "no file name"),
                                        ("tokens:", "no file name"), ("hf:wikitext", "tokens:FILE.npy")])
def test_bad_specs_are_refused(spec, says):
    with pytest.raises(InvalidInputError, match=says):
        parse_data_spec(spec)


def test_reserved_prefixes_are_never_imported(lm, tmp_path, monkeypatch):
    # A module named `text` on the path must not be imported for `text:foo`: that is the file foo.
    (tmp_path / "text.py").write_text("raise RuntimeError('imported!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    message = _error(lm, "text:foo")
    assert "'foo' does not exist" in message and "text" not in sys.modules


# --------------------------------------------------------------------------- sources
def test_text_file_is_read_as_bytes_with_next_byte_targets(lm, tmp_path):
    body = ("stagewise plans pipelines; " * 20).encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(body)
    source = make_source(lm, kind=f"text:{path}", seq=SEQ, seed=1)
    assert isinstance(source, FileSource)
    (x,), y = source.batch(0, 4)
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    for row in x.tolist():  # every window is a slice of the file
        assert bytes(row) in body


def test_npy_and_bin_files_give_the_same_batches(lm, tmp_path):
    ids = _ids(500)
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    ids.astype("<u2").tofile(tmp_path / "ids.bin")
    a = make_source(lm, kind=f"tokens:{tmp_path / 'ids.npy'}", seq=SEQ, seed=2).batch(5, 3)
    b = make_source(lm, kind=f"tokens:{tmp_path / 'ids.bin'}", seq=SEQ, seed=2).batch(5, 3)
    torch.testing.assert_close(a, b)
    (x,), y = a
    assert int(x.max()) < 256 and x.dtype == torch.long
    # the ids repeat with period 256, so a window is fixed by its first id: compare with its first occurrence
    starts = [int(np.flatnonzero(ids == row[0])[0]) for row in x.tolist()]
    for row, target, start in zip(x.tolist(), y.tolist(), starts):
        window = ids[start:start + SEQ + 1].tolist()
        assert (row, target) == (window[:-1], window[1:])


def test_batches_are_a_function_of_step_and_seed_and_microbatches_tile_them(lm, tmp_path):
    _ids(1000).astype("<u2").tofile(tmp_path / "ids.bin")
    spec = f"tokens:{tmp_path / 'ids.bin'}"
    whole = PlanBatches(make_source(lm, kind=spec, seq=SEQ, seed=4), global_batch=6, microbatch_size=2)
    other_rank = PlanBatches(make_source(lm, kind=spec, seq=SEQ, seed=4), global_batch=6, microbatch_size=2)
    (x,), y = whole.global_step_batch(3)
    for mb in reversed(range(3)):  # any order, any process: the same rows
        (xm,), ym = other_rank.microbatch(3, mb)
        torch.testing.assert_close(xm, x[2 * mb:2 * mb + 2])
        torch.testing.assert_close(ym, y[2 * mb:2 * mb + 2])
    assert not torch.equal(whole.global_step_batch(4)[0][0], x)
    reseeded = make_source(lm, kind=spec, seq=SEQ, seed=5).batch(3, 6)
    assert not torch.equal(reseeded[0][0], x)


def test_builtin_kinds_are_unchanged(lm):
    assert isinstance(make_source(lm, kind="text", seq=SEQ), TextSource)
    assert isinstance(make_source(lm, kind="synthetic", seq=SEQ), SyntheticSource)


def test_a_file_exactly_one_sequence_plus_one_long_is_enough(lm, tmp_path):
    _ids(SEQ + 1).astype("<u2").tofile(tmp_path / "ids.bin")
    (x,), y = make_source(lm, kind=f"tokens:{tmp_path / 'ids.bin'}", seq=SEQ).batch(0, 2)
    assert x[0].tolist() == _ids(SEQ).tolist() and y[0].tolist() == _ids(SEQ + 1)[1:].tolist()


# --------------------------------------------------------------------------- bad files
def _write_bad(tmp_path, case: str) -> str:
    if case == "missing":
        return f"tokens:{tmp_path / 'absent.bin'}"
    if case == "empty bin":
        (tmp_path / "e.bin").write_bytes(b"")
        return f"tokens:{tmp_path / 'e.bin'}"
    if case == "empty text":
        (tmp_path / "e.txt").write_bytes(b"")
        return f"text:{tmp_path / 'e.txt'}"
    if case == "short text":
        (tmp_path / "s.txt").write_bytes(b"x" * SEQ)
        return f"text:{tmp_path / 's.txt'}"
    if case == "short npy":
        np.save(tmp_path / "s.npy", _ids(SEQ))
        return f"tokens:{tmp_path / 's.npy'}"
    if case == "id >= vocab":
        np.save(tmp_path / "v.npy", np.append(_ids(100), 256))
        return f"tokens:{tmp_path / 'v.npy'}"
    if case == "negative id":
        np.save(tmp_path / "n.npy", np.append(_ids(100), -1))
        return f"tokens:{tmp_path / 'n.npy'}"
    if case == "float npy":
        np.save(tmp_path / "f.npy", _ids(100).astype(np.float32))
        return f"tokens:{tmp_path / 'f.npy'}"
    if case == "2-D npy":
        np.save(tmp_path / "m.npy", _ids(100).reshape(10, 10))
        return f"tokens:{tmp_path / 'm.npy'}"
    if case == "object npy":
        np.save(tmp_path / "o.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
        return f"tokens:{tmp_path / 'o.npy'}"
    if case == "pickle as npy":
        (tmp_path / "p.npy").write_bytes(pickle.dumps(list(range(100))))
        return f"tokens:{tmp_path / 'p.npy'}"
    if case == "odd bin":
        (tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 50 + b"\x02")
        return f"tokens:{tmp_path / 'odd.bin'}"
    if case == "other suffix":
        (tmp_path / "ids.csv").write_text("1,2,3\n")
        return f"tokens:{tmp_path / 'ids.csv'}"
    if case == "folder":
        (tmp_path / "dir.bin").mkdir()
        return f"tokens:{tmp_path / 'dir.bin'}"
    raise AssertionError(case)


BAD = {"missing": "does not exist", "empty bin": "is empty", "empty text": "is empty",
       "short text": "at least one sequence + 1 = 17 tokens", "short npy": "at least one sequence + 1",
       "id >= vocab": "ids from 0 to 256", "negative id": "ids from -1 to", "float npy": "float32 array",
       "2-D npy": "shape (10, 10)", "object npy": "a .npy array saved by numpy.save",
       "pickle as npy": "a .npy array saved by numpy.save", "odd bin": "odd byte count",
       "other suffix": "a .npy or .bin file", "folder": "expected a file"}


NEEDS_MODEL = {"short text", "short npy", "id >= vocab", "negative id"}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_file_is_one_clear_error(lm, tmp_path, case):
    spec = _write_bad(tmp_path, case)
    message = _error(lm, spec)
    assert BAD[case] in message, message
    with pytest.raises(InvalidInputError):  # the launcher's check says the same before any rank starts
        check_data(lm, kind=spec, seq=SEQ)
    if case in NEEDS_MODEL:  # the command line's first check knows no sequence length or vocabulary
        check_data_file(spec)
    else:
        with pytest.raises(InvalidInputError, match=re.escape(BAD[case])):
            check_data_file(spec)


def test_token_bounds_follow_the_model_vocabulary(tmp_path):
    small = build_model("tests.unit.test_data_specs:small_vocab_gpt", batch=2, seq=SEQ, device="meta")
    assert small.vocab_or_classes == 100
    np.save(tmp_path / "ok.npy", _ids(200, vocab=100).astype(np.uint8))
    (x,), _ = make_source(small, kind=f"tokens:{tmp_path / 'ok.npy'}", seq=SEQ).batch(0, 8)
    assert int(x.max()) < 100
    np.save(tmp_path / "big.npy", _ids(200, vocab=101).astype(np.uint8))
    assert "token ids in [0, 100)" in _error(small, f"tokens:{tmp_path / 'big.npy'}")
    (tmp_path / "t.txt").write_text("hello world " * 10)
    message = _error(small, f"text:{tmp_path / 't.txt'}")
    assert "vocabulary of at least 256" in message and "vocab 100" in message


def test_models_that_do_not_take_token_ids_refuse_files(tmp_path):
    mlp = build_model("mlp-tiny", batch=2, device="meta")
    np.save(tmp_path / "ids.npy", _ids(100))
    assert "a language model taking token ids" in _error(mlp, f"tokens:{tmp_path / 'ids.npy'}")


def test_the_launcher_check_leaves_factories_to_the_ranks(lm):
    check_data(lm, kind="no_such_module_anywhere:factory", seq=SEQ)  # imported where it is meant to run
    with pytest.raises(InvalidInputError):
        make_source(lm, kind="no_such_module_anywhere:factory", seq=SEQ)
