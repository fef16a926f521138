"""The user's text through the model's own tokenizer: a model folder (``hf:FOLDER``) that holds a saved
tokenizer trains on ``--data text:FILE`` as that tokenizer encodes it (offline); bytes otherwise."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from models import hf_tokens  # noqa: E402
from models.registry import build_model  # noqa: E402
from planner.errors import InvalidInputError  # noqa: E402
from planner.runtime.data import make_source  # noqa: E402

TEXT = "the cat sat on the mat. the dog sat on the log. " * 40


def _model_folder(tmp_path, vocab_size: int = 64):
    """A tiny GPT-2 config and a word-level tokenizer trained here on TEXT, saved as save_pretrained saves."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(tmp_path)
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": vocab_size,
              "n_positions": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, fast


def test_text_file_is_encoded_by_the_models_own_tokenizer(tmp_path):
    folder, fast = _model_folder(tmp_path / "model")
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    assert hf_tokens.tokenizer_folder(f"hf:{folder}") == folder
    bundle = build_model(f"hf:{folder}", batch=2, seq=8)
    source = make_source(bundle, kind=f"text:{text}", seq=8)
    (idx,), targets = source.batch(0, 2)
    ids = fast(TEXT, add_special_tokens=False)["input_ids"]
    assert idx.shape == (2, 8) and int(idx.max()) < len(fast)
    # every window is a run of the tokenizer's ids, and the targets are the next tokens
    for row, tgt in zip(idx.tolist(), targets.tolist()):
        starts = [i for i in range(len(ids) - 8) if ids[i:i + 8] == row]
        assert starts and ids[starts[0] + 1:starts[0] + 9] == tgt


def test_a_tokenizer_beyond_the_models_vocabulary_is_refused(tmp_path):
    folder, fast = _model_folder(tmp_path / "model", vocab_size=4)  # fewer ids than the tokenizer makes
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    bundle = build_model(f"hf:{folder}", batch=2, seq=8)
    with pytest.raises(InvalidInputError, match="below the model's vocabulary 4"):
        make_source(bundle, kind=f"text:{text}", seq=8)


def test_a_model_type_spec_has_no_tokenizer_and_reads_bytes():
    assert hf_tokens.tokenizer_folder("hf:gpt2?n_layer=1,n_embd=16,n_head=2,vocab_size=256") is None
    assert hf_tokens.tokenizer_folder("gpt-tiny") is None
