"""Checkpoints restored from their owners: a signed manifest says who wrote each file (and its sha256) and
whose file each parameter is read from; what does not match is refused and blamed on its writer."""
from __future__ import annotations

import json

import pytest
import torch

from planner.errors import CheckpointError, InvalidInputError
from planner.runtime.recovery import checkpoint

KEY = b"k" * 32
# rank 0 (trusted) runs the embedding and the head, rank 1 (a volunteer) the middle layer
LAYOUT = checkpoint.Layout(num_ranks=2, fingerprint="f", hosts={0: "dc", 1: "volunteer"},
                           holders={"embed": (0,), "mid": (1,), "head": (0,)}, trusted=frozenset({0}))


def _take(root, step: int, *, poison: bool = False) -> dict[str, torch.Tensor]:
    honest = {"embed": torch.full((2,), float(step)), "head": torch.full((3,), float(step)),
              "mid": torch.full((4,), 10.0 + step)}
    digests = {0: checkpoint.save_rank(root, step=step, rank=0, fingerprint="f", optimizer=None,
                                       params={"embed": honest["embed"], "head": honest["head"]}),
               1: checkpoint.save_rank(root, step=step, rank=1, fingerprint="f", optimizer=None,
                                       params={"mid": honest["mid"],
                                               **({"head": torch.full((3,), -1e6)} if poison else {})})}
    checkpoint.complete(root, step=step, layout=LAYOUT, key=KEY, digests=digests)
    return honest


def _restore(root, step: int, names: dict[str, int], rank: int = 0) -> dict[str, torch.Tensor]:
    params = {n: torch.nn.Parameter(torch.zeros(size)) for n, size in names.items()}
    checkpoint.restore_rank(root, step=step, params=params, optimizer=None, rank=rank, key=KEY)
    return {n: p.detach() for n, p in params.items()}


def test_a_parameter_is_read_from_its_owners_file_only_so_a_volunteer_cannot_plant_the_head(tmp_path):
    honest = _take(tmp_path, 3, poison=True)
    manifest = json.loads((checkpoint.step_folder(tmp_path, 3) / checkpoint.MANIFEST).read_text())
    assert manifest["owners"] == {"embed": 0, "mid": 1, "head": 0}
    assert manifest["files"]["rank1.safetensors"]["host"] == "volunteer"
    got = _restore(tmp_path, 3, {"head": 3, "mid": 4}, rank=2)            # a new layout's rank holding both
    torch.testing.assert_close(got["head"], honest["head"])
    torch.testing.assert_close(got["mid"], honest["mid"])
    assert checkpoint.read_params(tmp_path, step=3, names={"head"}, key=KEY)["head"].tolist() == [3.0] * 3


def test_a_name_the_plan_gives_nobody_goes_to_a_trusted_holder_first():
    layout = checkpoint.Layout(num_ranks=3, fingerprint="f", hosts={}, holders={}, trusted=frozenset({2}))
    assert layout.owners({0, 1, 2}, {0: {"x"}, 2: {"x", "y"}, 1: {"z"}}) == {"x": 2, "y": 2, "z": 1}


def test_a_file_replaced_after_its_manifest_is_refused_blamed_on_its_writer_and_the_run_falls_back(tmp_path):
    _take(tmp_path, 1)
    _take(tmp_path, 2)
    bad = checkpoint.step_folder(tmp_path, 2) / "rank1.safetensors"
    checkpoint.write_rank_file(bad, step=2, rank=1, fingerprint="f", params={"mid": torch.full((4,), 99.0)},
                               optimizer=None, state=None, rng=torch.get_rng_state())
    found = checkpoint.latest(tmp_path, fingerprint="f", key=KEY)
    assert found.step == 1
    assert len(found.refused) == 1 and "step 2: rank 1's file" in found.refused[0]
    assert "host volunteer" in found.refused[0]
    with pytest.raises(CheckpointError) as err:                          # a rank that reads it anyway
        _restore(tmp_path, 2, {"mid": 4}, rank=0)
    assert err.value.writer == 1                                         # the writer, not the reader (rank 0)
    assert _restore(tmp_path, 2, {"head": 3})["head"].tolist() == [2.0] * 3  # rank 0's own file is intact


@pytest.mark.parametrize("spoil", ["unsigned", "other-secret", "corrupt", "edited"])
def test_an_unsigned_corrupt_or_edited_manifest_falls_back_to_the_newest_good_checkpoint(tmp_path, spoil):
    _take(tmp_path, 4)
    _take(tmp_path, 5)
    path = checkpoint.step_folder(tmp_path, 5) / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    if spoil == "unsigned":
        del manifest["signature"]
    elif spoil == "other-secret":
        body = {k: v for k, v in manifest.items() if k != "signature"}
        from planner import secret
        manifest["signature"] = secret.sign(b"x" * 32, body)
    elif spoil == "edited":
        manifest["owners"]["head"] = 1                                  # the volunteer's file for the head
    path.write_text("{not json" if spoil == "corrupt" else json.dumps(manifest))
    found = checkpoint.latest(tmp_path, fingerprint="f", key=KEY)
    assert found.step == 4 and found.refused[0].startswith("step 5: manifest")
    with pytest.raises(CheckpointError):
        _restore(tmp_path, 5, {"head": 3})


def test_no_usable_checkpoint_is_one_error_saying_why(tmp_path):
    _take(tmp_path, 1)
    (checkpoint.step_folder(tmp_path, 1) / checkpoint.MANIFEST).write_text("[]")
    with pytest.raises(InvalidInputError) as err:
        checkpoint.latest(tmp_path, fingerprint="f", key=KEY)
    assert "\n" not in str(err.value) and "step 1: manifest" in str(err.value)


def test_another_models_checkpoint_is_an_error_not_a_fallback(tmp_path):
    _take(tmp_path, 1)
    with pytest.raises(InvalidInputError, match="one of this plan's model"):
        checkpoint.latest(tmp_path, fingerprint="g", key=KEY)
