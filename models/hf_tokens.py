"""The tokenizer saved beside an ``hf:`` model's config, read offline: text data for its runs."""
from __future__ import annotations

from pathlib import Path

from models.hf import is_hf_spec, parse_hf_spec, quiet, transformers
from planner.errors import InvalidInputError, first_line

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_folder(spec: str) -> Path | None:
    """The folder of an ``hf:`` path spec (the folder itself, or the one holding its config file), else None."""
    if not is_hf_spec(spec):
        return None
    hs = parse_hf_spec(spec)
    if not hs.is_path:
        return None
    folder = Path(hs.source)
    return folder if folder.is_dir() else folder.parent


def tokenizer_folder(spec: str) -> Path | None:
    """The model folder of an ``hf:`` spec when it holds a tokenizer (read offline), else None."""
    folder = model_folder(spec)
    if folder is None:
        return None
    return folder if any((folder / name).is_file() for name in _TOKENIZER_FILES) else None


def tokenize(folder: Path, text: str) -> list[int]:
    """``text`` as the token ids of the tokenizer saved in ``folder`` (offline, no remote code)."""
    library = transformers()
    try:
        with quiet():
            tok = library.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
            return list(tok(text, add_special_tokens=False)["input_ids"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidInputError(f"the tokenizer in {str(folder)!r}", expected="a tokenizer transformers can load "
                                "offline", found=first_line(exc),
                                fix="save one with tokenizer.save_pretrained(folder), or pass --data tokens:FILE.npy")
