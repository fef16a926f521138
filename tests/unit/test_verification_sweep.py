"""The strength sweep's machinery on two strengths of one attack (a few seconds): an identity
"attack" is neither blamed nor harmful, a sign flip is caught, banned and harmful."""
from __future__ import annotations

from benchmarks.verification_sweep import (
    HARMLESS_NATS,
    SweepConfig,
    plot,
    spec_for,
    sweep,
    verdict,
)


def test_sweep_tells_a_caught_attack_from_a_harmless_one(tmp_path):
    cfg = SweepConfig(seeds=(0,), start=10, attack_steps=8)
    report = sweep(cfg, {"scale act": (1.0, -1.0)})
    same, flip = report["points"]
    assert [same["strength"], flip["strength"]] == [1.0, -1.0]
    assert flip["spec"] == spec_for("scale act", -1.0) == "kind=scale,factor=-1.0"
    assert same["first_attacked_step"] == flip["first_attacked_step"] == [10]

    # factor 1 sends the honest tensor: nobody blamed, nobody banned, no damage at all.
    assert (same["tp"], same["fp"]) == (0, 0)
    assert same["detect_delay_steps"] == same["ban_delay_steps"] == [None]
    assert same["attacker_banned"] == [False] and same["honest_banned"] == []
    assert same["damage_unverified"] == 0.0
    assert verdict(same) == "missed, harmless"

    # the sign flip: blamed from its first step, banned within the ban test's 5 steps, no one else.
    assert flip["f1"] >= 0.95 and flip["fp"] == 0
    assert flip["detect_delay_steps"] == [0]
    assert flip["ban_delay_steps"][0] is not None and flip["ban_delay_steps"][0] <= 5
    assert flip["attacker_banned"] == [True] and flip["honest_banned"] == []
    assert flip["damage_unverified"] > 2 * HARMLESS_NATS
    assert verdict(flip) == "banned"

    assert set(report["clean_val_loss"]) == {"18 steps, seed 0"}
    out = tmp_path / "sweep.png"
    plot(report, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
