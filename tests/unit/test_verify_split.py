"""Monitors without the sending stage's input (a split placement: no link, residual or gain test):
activation floors of their own, and step fences no looser than their samples'."""
from __future__ import annotations

import math

import torch

from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.blame import blame_weights
from planner.integrity.verifier import Verifier
from planner.verifier_config import DEFAULT_FLOORS, VerifierConfig
from tests.unit.test_verify import MBS, D, Stream, run

torch.set_num_threads(1)


def test_activations_have_a_scale_floor_of_their_own() -> None:
    v = Verifier({"warmup": 5}, [(0, "act"), (0, "grad")])
    act, grad = v.monitor(0, "act"), v.monitor(0, "grad")
    assert act.fences["scale"].floor == act.step_fences["scale"].floor == 0.5
    assert grad.fences["scale"].floor == grad.step_fences["scale"].floor == DEFAULT_FLOORS["scale"]
    assert act.fences["mad"].floor == grad.fences["mad"].floor     # only the floors named are replaced
    shared = Verifier({"warmup": 5, "act_floors": {}}, [(0, "act")])
    assert shared.monitor(0, "act").fences["scale"].floor == DEFAULT_FLOORS["scale"]
    cfg = VerifierConfig.from_dict({"act_floors": {"scale": 0.4}})
    assert VerifierConfig.from_dict(cfg.to_dict()) == cfg


def test_damped_activations_are_flagged_every_step_and_their_sender_banned() -> None:
    # 0.5 is 0.69 e-folds: inside the raw scale's floor of 1.0 (set for gradients), so without the
    # stage's input the first damped step passed, was learnt, and the damping was never seen again.
    v = Verifier({"warmup": 5}, [(0, "act")])
    attacker = Attacker(parse_attack("rank=1,start=12,kind=scale,factor=0.5"), seed=0)
    flags = run(v, 22, attacker=attacker)
    assert not any(flags[s] for s in range(12))
    for step in range(12, 22):
        if 1 in v.banned and step > min(s for s, _ in v.ban_records().values()):
            break
        assert any(e["sender"] == 1 and "scale" in e["reasons"] for e in flags[step]), (step, flags[step])
    first, banned_at = v.ban_records()[1]
    assert first == 12 and banned_at - 12 <= 10


def test_a_step_fence_is_never_looser_than_its_samples() -> None:
    v = Verifier({"warmup": 5}, [(0, "act")])
    stream = Stream(3)
    for step in range(30):
        for mb in range(4):
            # turbulent early steps (a size that swings) fill the step window with large scores
            x, lab = stream.sample(step)
            v.check(0, "act", x * (1.0 + (0.3 * (-1) ** step if step < 14 else 0.0)), step=step, mb=mb, sender=1,
                    labels=lab)
        v.end_step(step, [v.flag_events(step)])
    mon = v.monitor(0, "act")
    sample, whole = mon.fence_values(), mon.fence_values(per_sample=False)
    for name, fence in whole.items():
        if fence is not None and sample.get(name) is not None:
            assert fence <= sample[name] + 1e-12, name


def test_a_step_is_vouched_for_by_the_surrogate_as_its_samples_are() -> None:
    # An honest shift the stage's surrogate explains sample by sample (link well under its fence)
    # must not fail as a step because the step's own link fence is tighter.
    mon = Verifier({"warmup": 0}, [(0, "act")]).monitor(0, "act")
    mon.first_step = 0
    for value in (0.05, 0.06, 0.07, 0.08) * 4:
        for name in mon.fences:
            mon.fences[name].update(value)
        for name in mon.step_fences:
            mon.step_fences[name].update(value / 5)
    sample_link, step_link = mon.fences["link"].fence(), mon.step_fences["link"].fence()
    assert step_link < sample_link
    link = 0.45 * sample_link                 # under half the samples' link fence, over half the step's
    assert 0.5 * step_link < link < step_link
    shifted = {"spectral": 0.5, "link": link}
    assert mon.exceeded(shifted, 20) == ()                       # a sample: vouched for
    assert mon.exceeded(shifted, 20, per_sample=False) == ()     # its step: vouched for alike
    assert mon.exceeded({"spectral": 0.5, "link": 0.6 * sample_link}, 20, per_sample=False) == ("spectral",)


def test_a_lone_flag_upstream_neither_takes_nor_hides_a_step_flag_downstream() -> None:
    from planner.integrity.blame import STEP_MB, blame_weights

    def flag(step: int, mb: int, boundary: int, direction: str, sender: int) -> dict:
        return {"type": "flag", "step": step, "mb": mb, "boundary": boundary, "direction": direction,
                "sender": sender, "scope": "step" if mb == STEP_MB else "microbatch", "scores": {}, "fences": {},
                "reasons": ["gain" if mb == STEP_MB else "link"]}

    lone_upstream = flag(23, 2, 1, "act", 1)            # an honest stage's odd microbatch, forward
    attacker_step = flag(23, STEP_MB, 1, "grad", 2)     # the attacker's step, backward
    assert blame_weights([lone_upstream, attacker_step]) == {1: 1.0, 2: math.inf}
    v = Verifier({}, [(1, "act"), (1, "grad")])
    v.end_step(23, [[lone_upstream, attacker_step]])
    assert v.last_blamed == {2}                          # the lone flag alone is no evidence
    damper = [flag(5, mb, 1, "act", 1) for mb in (0, 1, 2)]
    assert blame_weights([*damper, flag(5, STEP_MB, 2, "act", 2)]) == {1: 3.0}   # upstream flags still win


def test_a_shape_shift_without_the_stage_s_input_is_an_alert_the_monitor_follows() -> None:
    # An honest stage whose gradients take on energy in new directions at step 14 and keep it (gpt-tiny's
    # rank 1 at a loss wave, split placement): only shape tests object, nothing vouches for or against
    # it. Its steps are flagged as alerts that blame nobody, and the monitor learns the new shape.
    v = Verifier({"warmup": 5}, [(0, "grad")])
    stream, gen = Stream(1), torch.Generator().manual_seed(4)
    new = torch.linalg.qr(torch.randn(D, 3, generator=gen))[0].T       # 3 directions, zero mean
    alerts = []
    for step in range(60):
        for mb in range(MBS):
            x, lab = stream.sample(step)
            if step >= 14:
                x = x + 1.5 * x.std() * torch.randn(*x.shape[:-1], 3, generator=gen) @ new
            v.check(0, "grad", x, step=step, mb=mb, sender=1, labels=lab)
        events = v.flag_events(step)
        assert all(e["scope"] == "step" and set(e["reasons"]) <= {"mad", "l2", "swd", "spectral", "skew"}
                   for e in events), events
        assert blame_weights(events) == {}
        alerts += [step for e in events]
        v.end_step(step, [events])
    assert alerts and min(alerts) == 14 and max(alerts) < 30, alerts   # seen, then learnt
    assert not v.banned and not v.ban_records()
