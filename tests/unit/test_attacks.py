"""The attack harness: parsing ``--attack`` specs and what each kind does to a tensor."""
from __future__ import annotations

import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity.attacks import (
    KIND_PARAMS,
    Attacker,
    AttackSpec,
    feature_pattern,
    parse_attack,
)

torch.set_num_threads(1)


def tensor(seed: int = 0, shape: tuple[int, ...] = (4, 16, 32)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * 0.3 + torch.linspace(-1, 1, shape[-1])


def attack(spec: str, seed: int = 0) -> Attacker:
    return Attacker(parse_attack(spec), seed=seed)


# ---------------------------------------------------------------------------- parsing

def test_parse_the_documented_example() -> None:
    spec = parse_attack("rank=2,kind=scale,factor=-1,start=5,p=1.0,dir=act")
    assert spec == AttackSpec(rank=2, kind="scale", start=5, p=1.0, direction="act", params=(("factor", -1.0),))
    assert spec.to_dict() == {"rank": 2, "kind": "scale", "start": 5, "p": 1.0, "dir": "act", "factor": -1.0}


def test_defaults_per_kind() -> None:
    assert parse_attack("rank=1,kind=zeros") == AttackSpec(rank=1, kind="zeros")
    assert parse_attack("rank=1,kind=sign_flip").direction == "grad"
    assert parse_attack("rank=1,kind=random_sign").direction == "grad"
    assert parse_attack("rank=1, kind=noise ").param("std") == KIND_PARAMS["noise"]["std"]
    assert parse_attack("rank=1,kind=delay,steps=3").param("steps") == 3
    assert parse_attack("rank=1,kind=adaptive,target=noise").param("target") == "noise"
    assert parse_attack("rank=1,kind=adaptive").param("model") == "summary"
    assert parse_attack("rank=1,kind=adaptive,model=full").param("model") == "full"
    assert parse_attack("rank=0,kind=bias,dir=both").targets("grad")


@pytest.mark.parametrize("spec, key", [
    ("kind=zeros", "'rank'"),
    ("rank=1", "'kind'"),
    ("rank=1,kind=melt", "'kind'"),
    ("rank=1,kind=zeros,factor=2", "'factor'"),
    ("rank=1,kind=zeros,colour=red", "'colour'"),
    ("rank=x,kind=zeros", "'rank'"),
    ("rank=1,kind=scale,factor=big", "'factor'"),
    ("rank=1,kind=zeros,p=0", "'p'"),
    ("rank=1,kind=zeros,p=1.5", "'p'"),
    ("rank=1,kind=zeros,start=-2", "'start'"),
    ("rank=-1,kind=zeros", "'rank'"),
    ("rank=1,kind=zeros,dir=sideways", "'dir'"),
    ("rank=1,kind=zeros,rank=2", "'rank'"),
    ("rank=1,kind=delay,steps=0", "'steps'"),
    ("rank=1,kind=delay,steps=1.5", "'steps'"),
    ("rank=1,kind=noise,std=0", "'std'"),
    ("rank=1,kind=bias,value=1,rel=2", "'rel'"),
    ("rank=1,kind=adaptive,target=delay", "'target'"),
    ("rank=1,kind=adaptive,margin=2", "'margin'"),
    ("rank=1,kind=adaptive,model=oracle", "'model'"),
    ("rank=1,kind=zeros,start", "'start'"),
])
def test_bad_specs_name_the_key(spec: str, key: str) -> None:
    with pytest.raises(InvalidInputError, match=key):
        parse_attack(spec)


# ---------------------------------------------------------------------------- what each kind does

def test_constant_zeros_scale_and_sign_flip() -> None:
    x = tensor()
    assert torch.equal(attack("rank=0,kind=constant,value=2.5").apply(x, direction="act", step=0, mb=0),
                       torch.full_like(x, 2.5))
    assert torch.equal(attack("rank=0,kind=zeros").apply(x, direction="act", step=0, mb=0), torch.zeros_like(x))
    assert torch.allclose(attack("rank=0,kind=scale,factor=3").apply(x, direction="act", step=0, mb=0), 3 * x)
    assert torch.equal(attack("rank=0,kind=sign_flip").apply(x, direction="grad", step=0, mb=0), -x)


def test_random_keeps_global_statistics_but_not_the_values() -> None:
    x = tensor()
    y = attack("rank=0,kind=random").apply(x, direction="act", step=0, mb=0)
    assert float(y.mean()) == pytest.approx(float(x.mean()), abs=0.02)
    assert float(y.std()) == pytest.approx(float(x.std()), rel=0.03)
    assert abs(float(torch.corrcoef(torch.stack([x.reshape(-1), y.reshape(-1)]))[0, 1])) < 0.05


def test_random_sign_keeps_magnitudes_and_flips_about_half() -> None:
    x = tensor()
    y = attack("rank=0,kind=random_sign").apply(x, direction="grad", step=0, mb=0)
    assert torch.equal(y.abs(), x.abs())
    assert 0.45 < float((torch.sign(y) != torch.sign(x)).float().mean()) < 0.55


def test_bias_adds_a_fixed_pattern_over_the_features() -> None:
    x = tensor()
    a = attack("rank=0,kind=bias,rel=0.5")
    y1 = a.apply(x, direction="act", step=3, mb=0)
    pattern = feature_pattern(x, seed=0)
    assert torch.allclose(y1 - x, 0.5 * x.std(correction=0) * pattern.expand_as(x), atol=1e-6)
    y2 = a.apply(x, direction="act", step=9, mb=2)
    assert torch.allclose(y2 - x, y1 - x)                       # the same offset every time
    assert set(pattern.unique().tolist()) == {-1.0, 1.0}
    fixed = attack("rank=0,kind=bias,value=2").apply(x, direction="act", step=0, mb=0)
    assert torch.allclose((fixed - x).abs(), torch.full_like(x, 2.0))
    fmap = torch.randn(2, 5, 3, 3)                             # 4-D: the pattern runs over channels
    assert feature_pattern(fmap, seed=0).shape == (1, 5, 1, 1)


def test_noise_has_the_requested_relative_std() -> None:
    x = tensor(shape=(8, 64, 64))
    y = attack("rank=0,kind=noise,std=0.2").apply(x, direction="act", step=0, mb=0)
    assert float((y - x).std()) == pytest.approx(0.2 * float(x.std()), rel=0.03)
    assert abs(float((y - x).mean())) < 0.01


def test_delay_replays_the_tensor_of_k_steps_ago() -> None:
    a = attack("rank=1,kind=delay,steps=2,start=0")
    sent = {}
    for step in range(5):
        for mb in range(2):
            x = tensor(seed=10 * step + mb)
            sent[(step, mb)] = (x, a.apply(x, direction="act", step=step, mb=mb))
    for mb in range(2):
        for step in (0, 1):                    # nothing to replay yet: honest, and not logged
            assert sent[(step, mb)][1] is sent[(step, mb)][0]
        for step in (2, 3, 4):
            assert torch.equal(sent[(step, mb)][1], sent[(step - 2, mb)][0])
    assert a.attacked_steps() == {2, 3, 4}
    assert all(kind == "delay" for _, _, _, kind in a.log)


def test_mixed_draws_several_kinds_and_logs_them() -> None:
    a = attack("rank=0,kind=mixed,dir=both")
    for step in range(6):
        for mb in range(4):
            a.apply(tensor(seed=step), direction="act", step=step, mb=mb)
    kinds = {kind for _, _, _, kind in a.log}
    assert len(kinds) >= 4 and "mixed" not in kinds


def test_adaptive_is_honest_while_learning_then_blends_within_its_estimate() -> None:
    a = attack("rank=0,kind=adaptive,start=4,target=random,margin=0.7")
    outputs = []
    for step in range(10):
        for mb in range(4):
            x = tensor(seed=100 * step + mb)
            y = a.apply(x, direction="act", step=step, mb=mb)
            outputs.append((step, x, y))
    assert all(y is x for step, x, y in outputs if step < 4)
    late = [(x, y) for step, x, y in outputs if step >= 7]
    assert any(not torch.equal(x, y) for x, y in late)
    for x, y in late:                          # a blend: closer to the honest tensor than a random one is
        assert float((y - x).norm()) < float(x.norm())
    assert a.attacked_steps() <= set(range(4, 10))


def test_white_box_adaptive_learns_the_link_tests_and_uses_the_room_the_verifier_leaves() -> None:
    """Given its stage's input, ``model=full`` fits the stage's linear surrogate and its
    residuals as the verifier does, and knows the published fence floors: it corrupts
    more than the summary-only attacker, yet keeps the surrogate's residual far from
    what a random output would leave (a share of 1 or more)."""
    from planner.integrity import predictors as pred

    gen = torch.Generator().manual_seed(5)
    mix = torch.randn(32, 32, generator=gen) / 32 ** 0.5
    full, summary = attack("rank=0,kind=adaptive,start=6,model=full"), attack("rank=0,kind=adaptive,start=6")
    pairs = []
    for step in range(10):
        for mb in range(4):
            x = tensor(seed=100 * step + mb)
            y = x + torch.tanh(x @ mix)
            pairs.append((step, x, y, full.apply(y, direction="act", step=step, mb=mb, stage_input=x),
                          summary.apply(y, direction="act", step=step, mb=mb, stage_input=x)))
    state = full._adaptive["act"]
    assert state._fences["link"].ready and state._fences["residual"].ready
    late = [(x, y, yf, ys) for step, x, y, yf, ys in pairs if step >= 6]
    white = sum(float((yf - y).norm() / y.norm()) for _, y, yf, _ in late) / len(late)
    blind = sum(float((ys - y).norm() / y.norm()) for _, y, _, ys in late) / len(late)
    assert white > blind > 0.0

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, 32) / t.square().mean().sqrt()           # the verifier's unit rows

    train = [pred.link_stats(rows(x), rows(y)) for step, x, y, _, _ in pairs if step < 6]
    weights = pred.link_solve(*(sum(t[i] for t in train) / len(train) for i in (0, 1)))
    parts = [pred.link_parts(rows(x), rows(yf), weights) for x, _, yf, _ in late]
    assert max(num / den for num, den, _ in parts) < 0.5


# ---------------------------------------------------------------------------- gating and determinism

def test_start_probability_and_direction_gate_the_attack() -> None:
    x = tensor()
    a = attack("rank=0,kind=zeros,start=3,dir=grad")
    assert a.apply(x, direction="grad", step=2, mb=0) is x
    assert a.apply(x, direction="act", step=5, mb=0) is x
    assert torch.equal(a.apply(x, direction="grad", step=3, mb=0), torch.zeros_like(x))
    half = attack("rank=0,kind=zeros,p=0.5")
    hits = sum(half.apply(x, direction="act", step=s, mb=m) is not x for s in range(25) for m in range(8))
    assert 70 < hits < 130
    with pytest.raises(InvalidInputError, match="direction"):
        a.apply(x, direction="up", step=0, mb=0)


def test_deterministic_given_the_seed_and_leaves_global_rng_alone() -> None:
    x = tensor()
    state = torch.get_rng_state()
    y1 = attack("rank=0,kind=noise", seed=7).apply(x, direction="act", step=4, mb=1)
    y2 = attack("rank=0,kind=noise", seed=7).apply(x, direction="act", step=4, mb=1)
    y3 = attack("rank=0,kind=noise", seed=8).apply(x, direction="act", step=4, mb=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)


def test_input_untouched_and_dtype_kept() -> None:
    x = tensor().to(torch.bfloat16)
    before = x.clone()
    y = attack("rank=0,kind=noise").apply(x, direction="act", step=0, mb=0)
    assert torch.equal(x, before) and y.dtype == torch.bfloat16 and y.shape == x.shape
