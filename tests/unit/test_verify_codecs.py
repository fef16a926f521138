"""The monitors on compressed boundaries: what they check is the decoded tensor; honest rounding is not flagged,
a perturbation beyond the codec's error is, and so is a bias hidden inside it that keeps its direction."""
from __future__ import annotations

import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity.attacks import Attacker, parse_attack, quant_step
from planner.integrity.verifier import Verifier
from planner.runtime.wire import codecs as wire
from tests.unit.test_verify import D, Stream

torch.set_num_threads(1)

MBS = 4
WIRE = {"act": "F", "grad": "B"}
JITTER = 0.3   # a gradient's per-microbatch mean moves (relative to 1 for the features' spread): it does not persist


def wired(x: torch.Tensor, codec: str, direction: str) -> torch.Tensor:
    """What a receiver (and its verifier) gets: ``x`` encoded and decoded, as ``executor_p2p`` does."""
    d = WIRE[direction]
    return wire.decode(wire.encode(x, codec, d), codec, x.shape, x.dtype, d)


def run(codec: str, direction: str, steps: int, *, attack: str | None = None, offset: bool = False,
        perturb: float = 0.0, seed: int = 0) -> tuple[Verifier, dict[int, list[dict]]]:
    """``steps`` steps of boundary 0 from sender 1 under ``codec`` (``test_verify.Stream``'s tensors; gradients
    without its constant offset unless ``offset``, their mean moving from microbatch to microbatch);
    ``perturb``: from step 12, every element moved by that many quantization steps in a fixed direction *after*
    decoding (beyond the codec's error)."""
    stream, gen = Stream(seed), torch.Generator().manual_seed(seed + 7)
    v = Verifier({"warmup": 5}, [(0, direction)], codecs={0: codec})
    attacker = None if attack is None else Attacker(parse_attack(f"rank=1,start=12,dir={direction},{attack}"))
    pattern = torch.sign(torch.randn(D, generator=gen))
    flags = {}
    for step in range(steps):
        for mb in range(MBS):
            x, labels = stream.sample(step)
            if direction == "grad" and not offset:
                x = x - stream.offset - stream.emb.mean(0) @ stream.mix0 + JITTER * torch.randn(D, generator=gen)
            if attacker is not None:
                x = attacker.apply(x, direction=direction, step=step, mb=mb)
            y = wired(x, codec, direction)
            if perturb and step >= 12:
                y = y + perturb * quant_step(x, codec, direction) * pattern
            v.check(0, direction, y, step=step, mb=mb, sender=1, labels=labels)
        flags[step] = v.flag_events(step)
        v.end_step(step, [flags[step]])
    return v, flags


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("direction", ["act", "grad"])
def test_clean_quantized_tensors_are_never_flagged(codec: str, direction: str) -> None:
    v, flags = run(codec, direction, 30)
    assert not any(flags.values()), [e for f in flags.values() for e in f][:2]
    assert v.banned == set()


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_an_honest_persistent_gradient_mean_is_not_flagged(codec: str) -> None:
    # a constant offset makes every step's mean point the same way from the start: the sender's own level
    _, flags = run(codec, "grad", 30, offset=True)
    assert not any(flags.values()), [e for f in flags.values() for e in f][:2]


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_perturbation_beyond_the_codec_s_error_is_flagged(codec: str) -> None:
    v, flags = run(codec, "act", 20, perturb=40.0 if codec == "int8" else 3.0)
    assert not any(flags[s] for s in range(12))
    assert any(flags[s] for s in range(12, 20)) and v.banned == {1}


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_a_gradient_bias_inside_the_rounding_is_banned(codec: str) -> None:
    v, flags = run(codec, "grad", 22, attack=f"kind=quant_bias,codec={codec},frac=0.9")
    assert not any(flags[s] for s in range(12))
    assert {r for s in range(12, 22) for e in flags[s] for r in e["reasons"]} >= {"persist"}
    assert v.banned == {1} and v.ban_records()[1][1] <= 21


def test_without_a_codec_the_persistence_test_stays_off() -> None:
    v = Verifier({"warmup": 5}, [(0, "grad"), (1, "grad")], codecs={1: "int4"})
    assert not v.monitor(0, "grad").persists and v.monitor(1, "grad").persists


def test_quant_bias_moves_each_element_by_frac_of_its_step() -> None:
    x = Stream(3).sample(0)[0]
    for codec in ("fp8", "int8", "int4"):
        out = Attacker(parse_attack(f"rank=1,kind=quant_bias,codec={codec},frac=0.5")).apply(
            x, direction="act", step=0, mb=0)
        moved = (out - x).abs() / quant_step(x, codec, "act")
        assert torch.allclose(moved, torch.full_like(moved, 0.5), atol=1e-4)
        # honest rounding errs by at most half a step (fp8: of the binade's spacing, a step at most)
        assert float(((wired(x, codec, "act") - x).abs() / quant_step(x, codec, "act")).max()) <= 1.0


@pytest.mark.parametrize("spec, key", [("codec=int2", "'codec'"), ("frac=0", "'frac'"), ("frac=9", "'frac'")])
def test_quant_bias_rejects_bad_parameters(spec: str, key: str) -> None:
    with pytest.raises(InvalidInputError, match=key):
        parse_attack(f"rank=1,kind=quant_bias,{spec}")
