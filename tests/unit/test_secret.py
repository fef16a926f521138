"""The run secret and plan signatures: a plan file is checked as signed; an edit or another secret is refused."""
from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path

import pytest
from plan_fixtures import golden_plan

from planner.errors import InvalidInputError
from planner.runtime.launcher.membership import check_signature, load_signed_plan
from planner.secret import ENV_VAR, local_secret_path, run_secret
from planner.secret import digest as digest_of

KEY = b"0123456789abcdef0123456789abcdef"


def test_the_local_secret_is_created_once_and_readable_by_its_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv(ENV_VAR, raising=False)
    first = run_secret()
    assert run_secret() == first and len(first) >= 32
    assert stat.S_IMODE(local_secret_path().stat().st_mode) == 0o600
    local_secret_path().chmod(0o644)                            # readable by others: refused
    with pytest.raises(InvalidInputError, match="only its owner can read"):
        run_secret()
    monkeypatch.setenv(ENV_VAR, "short")
    with pytest.raises(InvalidInputError, match="at least 16 bytes"):
        run_secret()


def test_a_signed_plan_passes_and_an_edited_one_is_refused(tmp_path):
    path = golden_plan().save(tmp_path / "plan.json", secret=KEY)
    digest = check_signature(path, KEY)
    assert len(digest) == 64
    data = json.loads(path.read_text())
    data["policy"]["enabled"] = False                          # verification switched off by hand
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInputError, match="does not match its signature"):
        check_signature(path, KEY)


def test_a_signature_that_is_not_hex_is_refused_not_crashed(tmp_path):
    path = golden_plan().save(tmp_path / "plan.json", secret=KEY)
    data = json.loads(path.read_text())
    data["signature"] = "\u00e9" * 64
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInputError, match="does not match its signature"):
        check_signature(path, KEY)


def test_an_unsigned_plan_or_another_secret_is_refused(tmp_path):
    unsigned = golden_plan().save(tmp_path / "unsigned.json", sign=False)
    with pytest.raises(InvalidInputError, match="is not signed"):
        check_signature(unsigned, KEY)
    signed = golden_plan().save(tmp_path / "signed.json", secret=KEY)
    with pytest.raises(InvalidInputError, match="does not match its signature"):
        check_signature(signed, b"another secret of enough bytes!!")


def test_the_plan_loaded_is_the_one_whose_signature_was_checked(tmp_path, monkeypatch):
    """The file is read once: swapped for another signed plan after every read, what loads is still the
    first read's plan with that plan's hash (two reads would pair one plan with the other's hash)."""
    first = golden_plan()
    second = dataclasses.replace(first, config=dataclasses.replace(first.config, optimizer="sgd"))
    path = first.save(tmp_path / "plan.json", secret=KEY)
    swapped = second.save(tmp_path / "second.json", secret=KEY).read_bytes()
    reads = []
    read_text, read_bytes = Path.read_text, Path.read_bytes

    def then_swap(read):
        def reader(self, *args, **kwargs):
            data = read(self, *args, **kwargs)
            if self == path:
                reads.append(self)
                path.write_bytes(swapped)  # the file changes right after it is read
            return data
        return reader

    monkeypatch.setattr(Path, "read_text", then_swap(read_text))
    monkeypatch.setattr(Path, "read_bytes", then_swap(read_bytes))
    plan, digest = load_signed_plan(path, KEY)
    assert len(reads) == 1
    assert plan.config.optimizer == first.config.optimizer == "adam"
    assert digest == digest_of(first.to_dict()) != digest_of(second.to_dict())
