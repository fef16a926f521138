"""The integrity monitors on synthetic, drifting boundary tensors: warm-up, fences,
no learning from flagged samples, step-level tests, blame and bans."""
from __future__ import annotations

import json
import math

import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.blame import STEP_MB, blame
from planner.integrity.verifier import Verifier
from planner.verifier_config import VerifierConfig

torch.set_num_threads(1)

D, VOCAB, RANK, ROWS = 32, 40, 4, 64     # features, labels, latent rank, rows per microbatch
MBS = 4


class Stream:
    """Honest boundary tensors of a slowly drifting model: every row is its label's
    embedding plus context in a few latent directions (skewed, like real gradients)
    plus a little isotropic noise; the mixing matrix drifts step by step."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.emb = torch.randn(VOCAB, RANK, generator=gen)
        self.mix0 = torch.randn(RANK, D, generator=gen)
        self.mix1 = torch.randn(RANK, D, generator=gen)
        self.offset = torch.randn(D, generator=gen)

    def sample(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, VOCAB, (4, ROWS // 4), generator=self.gen)
        mix = self.mix0 + 0.01 * step * self.mix1
        context = torch.empty(4, ROWS // 4, RANK).exponential_(generator=self.gen) - 1.0
        latent = self.emb[labels] + 0.5 * context
        noise = 0.02 * torch.randn(4, ROWS // 4, D, generator=self.gen)
        return latent @ mix + self.offset + noise, labels


def run(verifier: Verifier, steps: int, *, attacker: Attacker | None = None, sender: int = 1,
        direction: str = "act", labels: bool = True, seed: int = 0) -> dict[int, list[dict]]:
    """Feed ``steps`` steps of MBS microbatches to boundary 0; returns the flags per step."""
    stream = Stream(seed)
    flags: dict[int, list[dict]] = {}
    for step in range(steps):
        for mb in range(MBS):
            x, lab = stream.sample(step)
            if attacker is not None:
                x = attacker.apply(x, direction=direction, step=step, mb=mb)
            verifier.check(0, direction, x, step=step, mb=mb, sender=sender, labels=lab if labels else None)
        flags[step] = verifier.flag_events(step)
        verifier.end_step(step, [flags[step]])
    return flags


def make(**config) -> Verifier:
    return Verifier({"warmup": 5, **config}, [(0, "act"), (0, "grad")])


# ---------------------------------------------------------------------------- clean and attacked streams

def test_clean_drifting_stream_is_never_flagged() -> None:
    for seed in range(2):
        v = make()
        flags = run(v, 50, seed=seed)
        assert not any(flags.values()), [e for f in flags.values() for e in f][:3]
        assert v.banned == set()


ATTACKS = ["kind=constant", "kind=zeros", "kind=random", "kind=scale,factor=-1", "kind=sign_flip,dir=act",
           "kind=random_sign,dir=act", "kind=delay,steps=2", "kind=mixed"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_each_attack_is_flagged_and_its_sender_banned(attack: str) -> None:
    v = make()
    attacker = Attacker(parse_attack(f"rank=1,start=12,{attack}"), seed=0)
    flags = run(v, 20, attacker=attacker)
    assert not any(flags[s] for s in range(12)), "flags before the attack started"
    flagged_steps = {s for s, f in flags.items() if f}
    assert flagged_steps >= {12, 13, 14} & attacker.attacked_steps()
    assert v.banned == {1}
    ban = next(e for e in v.events if e["type"] == "ban")
    assert ban["step"] <= 16          # the sequential test: five blamed steps at most


@pytest.mark.parametrize("attack", ["kind=bias,rel=0.5", "kind=noise,std=0.5"])
def test_a_shape_shift_bans_only_where_the_stage_s_input_is_seen(attack: str) -> None:
    # Without the sending stage's input only shape tests see these (spectral 1.3-1.8x its fence), as
    # they see an honest stage's change (evidence.UNLINKED_SHIFT): an alert. With it, the link bans.
    v = make()
    flags = run(v, 20, attacker=Attacker(parse_attack(f"rank=1,start=12,{attack}"), seed=0))
    assert flags[12] and all(e["scope"] == "step" for s in range(12, 20) for e in flags[s])
    assert v.banned == set()
    for direction in ("act", "grad"):
        v = Verifier({"warmup": 5}, [(0, direction), (1, direction)])
        run_stage(v, 20, direction, Attacker(parse_attack(f"rank=1,start=12,{attack},dir={direction}"), seed=0))
        assert v.banned == {1} and v.ban_records()[1] == (12, 16)


def test_gradient_sign_flip_is_caught_by_the_skew() -> None:
    v = make()
    attacker = Attacker(parse_attack("rank=2,start=12,kind=sign_flip"), seed=0)
    flags = run(v, 18, attacker=attacker, sender=2, direction="grad")
    reasons = {r for s in range(12, 16) for e in flags[s] for r in e["reasons"]}
    assert "skew" in reasons and v.banned == {2}


def test_delay_without_labels_is_still_caught_while_replaying_seen_tensors() -> None:
    v = make()
    attacker = Attacker(parse_attack("rank=1,start=12,kind=delay,steps=2"), seed=0)
    flags = run(v, 14, attacker=attacker, labels=False)
    assert {r for s in (12, 13) for e in flags[s] for r in e["reasons"]} == {"replay"}


def test_warmup_steps_are_taken_as_honest() -> None:
    v = make(warmup=8)
    attacker = Attacker(parse_attack("rank=1,start=0,kind=zeros"), seed=0)
    stream = Stream(0)
    for step in range(8):
        for mb in range(MBS):
            x, lab = stream.sample(step)
            verdict = v.check(0, "act", attacker.apply(x, direction="act", step=step, mb=mb), step=step, mb=mb,
                              sender=1, labels=lab)
            assert not verdict.flagged
        assert v.flag_events(step) == []


# ---------------------------------------------------------------------------- what flagged samples may not touch

def test_flagged_samples_move_neither_the_average_nor_the_windows() -> None:
    v = make()
    run(v, 10)
    mon = v.monitor(0, "act")
    ref, windows = mon.ref, {k: list(f._scores) for k, f in mon.fences.items()}
    step_windows = {k: list(f._scores) for k, f in mon.step_fences.items()}
    for mb in range(MBS):
        verdict = v.check(0, "act", torch.full((4, ROWS // 4, D), 3.0), step=10, mb=mb, sender=1)
        assert verdict.flagged and verdict.tainted and verdict.reasons
    v.end_step(10, [v.flag_events(10)])
    assert mon.ref is ref                                     # the reference object is untouched
    assert {k: list(f._scores) for k, f in mon.fences.items()} == windows
    assert {k: list(f._scores) for k, f in mon.step_fences.items()} == step_windows


def test_step_level_test_catches_what_each_microbatch_hides() -> None:
    # Per-microbatch spectral fences out of reach: only the step's average can flag.
    v = make(distances=["spectral"], floors={"spectral": 10.0})
    run(v, 10)
    mon = v.monitor(0, "act")
    ref = mon.ref
    noisy = Attacker(parse_attack("rank=1,kind=noise,std=0.5"), seed=0)
    stream = Stream(1)
    for mb in range(MBS):
        x, _ = stream.sample(10)
        verdict = v.check(0, "act", noisy.apply(x, direction="act", step=10, mb=mb), step=10, mb=mb, sender=1)
        assert not verdict.flagged
    flags = v.flag_events(10)
    assert [(e["mb"], e["scope"], e["reasons"]) for e in flags] == [(STEP_MB, "step", ["spectral"])]
    # without the stage's input a shape test's flag is an alert: learnt from, blaming nobody
    assert mon.ref is not ref
    assert v.end_step(10, [flags]) == set() and v.last_blamed == set() and mon.step_flags == 1


def test_tainted_arrivals_are_not_blamed_and_not_learnt() -> None:
    v = make()
    run(v, 8)
    mon = v.monitor(0, "act")
    ref = mon.ref
    verdict = v.check(0, "act", torch.zeros(4, ROWS // 4, D), step=8, mb=0, sender=1, tainted=True)
    assert verdict.tainted and not verdict.flagged
    assert v.flag_events(8) == []
    assert mon.ref is ref and mon.tainted == 1


def test_non_finite_tensors_are_flagged_at_once() -> None:
    v = make(warmup=100)
    x = torch.ones(4, 4, D)
    x[0, 0, 0] = float("nan")
    verdict = v.check(0, "grad", x, step=0, mb=0, sender=3)
    assert verdict.flagged and verdict.reasons == ("nonfinite",)


# ---------------------------------------------------------------------------- blame and bans

def flag(step: int, mb: int, boundary: int, direction: str, sender: int) -> dict:
    return {"type": "flag", "step": step, "mb": mb, "boundary": boundary, "direction": direction, "sender": sender}


def test_blame_goes_to_the_most_upstream_flag_of_each_microbatch() -> None:
    acts = [flag(0, 0, 2, "act", 2), flag(0, 0, 1, "act", 1)]
    assert blame(acts) == {1}                                   # lower boundary is upstream
    grads = [flag(0, 1, 0, "grad", 1), flag(0, 1, 2, "grad", 3)]
    assert blame(grads) == {3}                                  # higher boundary is upstream
    both = [flag(0, 2, 0, "grad", 1), flag(0, 2, 2, "act", 2)]
    assert blame(both) == {2}                                   # forward comes before backward
    assert blame(acts + grads) == {1, 3}                        # per microbatch
    assert blame([flag(0, STEP_MB, 1, "act", 1), flag(0, STEP_MB, 0, "grad", 1)]) == {1}


def test_a_step_level_flag_upstream_takes_the_blame_from_its_downstream_microbatches() -> None:
    """A damped stage 1 passes every per-sample test but its step as a whole is flagged; stage 2's
    microbatches, fed the damped activations, are flagged one by one: stage 1 alone is to blame."""
    damped = [flag(5, STEP_MB, 1, "act", 1)] + [flag(5, mb, 2, "act", 2) for mb in range(4)]
    assert blame(damped) == {1}
    assert blame(damped + [flag(6, 0, 2, "act", 2)]) == {1, 2}     # another step is another matter
    # upstream flags on several microbatches win the step; a lone one only its own microbatch
    assert blame([flag(5, STEP_MB, 2, "act", 2), flag(5, 0, 1, "act", 1), flag(5, 1, 1, "act", 1)]) == {1}
    assert blame([flag(5, STEP_MB, 2, "act", 2), flag(5, 0, 1, "act", 1)]) == {1, 2}


def test_a_sender_blamed_every_step_is_banned_by_the_sequential_test() -> None:
    v = Verifier({}, [(1, "act")])   # defaults: p0 0.05, p1 0.6, 1e5 steps: ceil(ln 1e5 / ln 12) = 5 blamed steps
    nested = lambda step, sender: [[flag(step, 0, 1, "act", sender), flag(step, 1, 1, "act", sender)], []]  # gathered
    assert [v.end_step(s, nested(s, 2)) for s in range(4)] == [set()] * 4
    assert v.end_step(4, nested(4, 2)) == {2}
    assert v.end_step(5, []) == {2}                             # the banned set is cumulative
    ban = next(e for e in v.events if e["type"] == "ban")
    assert ban["step"] == 4 and ban["blamed_steps"] == [0, 1, 2, 3, 4] and ban["evidence"] >= math.log(1e5)
    assert v.end_step(3, nested(9, 1)) == {2}                   # events of another step are ignored


def test_a_lone_flagged_microbatch_is_dropped_but_no_evidence() -> None:
    v = Verifier({}, [(1, "act")])
    lone = lambda step: [[flag(step, 3, 1, "act", 2)], []]
    for step in range(0, 40, 2):                                # one flagged microbatch every other step
        v.end_step(step, lone(step))
        assert v.last_blamed == set() and v.end_step(step + 1, []) == set()
    assert v.summary()["blamed_steps"] == {}
    v.end_step(40, lone(40))
    v.end_step(41, lone(41))                                    # two in a row: its second step is blamed
    assert v.last_blamed == {2} and v.summary()["blamed_steps"] == {"2": [41]}
    v.end_step(42, [[flag(42, STEP_MB, 1, "act", 2)], []])      # a step-level flag: its whole step
    assert v.last_blamed == {2}
    v.end_step(43, [[flag(43, 0, 1, "act", 2), flag(43, 5, 1, "act", 2)], []])   # two microbatches of a step
    assert v.last_blamed == {2} and v.summary()["blamed_steps"] == {"2": [41, 42, 43]}


def test_clean_steps_wear_evidence_down() -> None:
    v = Verifier({}, [(1, "act")])
    nested = lambda step, sender: [[flag(step, 0, 1, "act", sender), flag(step, 1, 1, "act", sender)], []]
    for step in range(300):                                     # blamed one step in five: drift < 0
        assert v.end_step(step, nested(step, 2) if step % 5 == 0 else []) == set()
    for step in range(300, 303):                                # three in a row after a clean stretch
        v.end_step(step, nested(step, 2))
    assert v.banned == set()


def test_events_are_plain_json_and_summary_reports() -> None:
    v = make()
    attacker = Attacker(parse_attack("rank=1,start=8,kind=zeros"), seed=0)
    run(v, 14, attacker=attacker)
    json.dumps(v.events)
    summary = v.summary()
    json.dumps(summary)
    act = next(m for m in summary["monitors"] if m["direction"] == "act")
    assert act["flagged"] > 0 and summary["banned"] == [1]


# ---------------------------------------------------------------------------- configuration

def test_config_defaults_and_overrides() -> None:
    cfg = VerifierConfig.from_dict({"beta_act": 0.95, "floors": {"spectral": 0.2}})
    assert cfg.beta_act == 0.95 and cfg.beta_grad == 0.8
    assert cfg.floors["spectral"] == 0.2 and cfg.floors["replay"] == 6.0
    assert VerifierConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("config, match", [
    ({"beta_act": 1.0}, "beta_act"),
    ({"window": 0}, "window"),
    ({"iqr_k": 0}, "iqr_k"),
    ({"warmup": -1}, "warmup"),
    ({"ban_honest_rate": 0.7}, "ban_honest_rate"),
    ({"ban_false_steps": 1}, "ban_false_steps"),
    ({"distances": ["mad", "telepathy"]}, "distances"),
    ({"distances": []}, "distances"),
    ({"floors": {"mad": -1}}, "floors.mad"),
    ({"betaact": 0.9}, "'betaact'"),
    ({"window": "many"}, "verifier_config"),
])
def test_bad_config(config: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        Verifier(config, [(0, "act")])


def test_bad_boundaries_and_checks() -> None:
    with pytest.raises(InvalidInputError, match="direction"):
        Verifier({}, [(0, "sideways")])
    v = Verifier({}, [(0, "act")])
    with pytest.raises(InvalidInputError, match="boundary 3"):
        v.check(3, "act", torch.ones(2, 4), step=0, mb=0, sender=0)
    v.check(0, "act", torch.ones(2, 4), step=0, mb=0, sender=0)
    verdict = v.check(0, "act", torch.ones(2, 5), step=0, mb=1, sender=0)   # the feature size changed
    assert verdict.flagged and verdict.reasons == ("shape",)


# ---------------------------------------------------------------------------- the stage-consistency (link) test

def run_stage(verifier: Verifier, steps: int, direction: str, attacker: Attacker | None) -> dict[int, list[dict]]:
    """A residual stage between boundaries 0 and 1: activations 0 -> 1, gradients 1 -> 0."""
    stream = Stream(3)
    mix = torch.randn(D, D, generator=torch.Generator().manual_seed(9)) / D ** 0.5
    (b_in, b_out, sender_in) = (0, 1, 0) if direction == "act" else (1, 0, 2)
    flags = {}
    for step in range(steps):
        for mb in range(MBS):
            x, _ = stream.sample(step)
            y = x + torch.tanh(x @ mix) if direction == "act" else x + 0.3 * x @ mix.T
            if attacker is not None:
                y = attacker.apply(y, direction=direction, step=step, mb=mb)
            verifier.check(b_in, direction, x, step=step, mb=mb, sender=sender_in)
            verifier.check(b_out, direction, y, step=step, mb=mb, sender=1)
        flags[step] = verifier.flag_events(step)
        verifier.end_step(step, [flags[step]])
    return flags


@pytest.mark.parametrize("direction, attack", [("act", "kind=delay,steps=2"), ("grad", "kind=sign_flip"),
                                               ("act", "kind=noise,std=1.0")])
def test_link_ties_a_stage_output_to_its_input(direction: str, attack: str) -> None:
    v = Verifier({"warmup": 5, "distances": ["link"]}, [(0, direction), (1, direction)])
    clean = run_stage(v, 12, direction, None)
    assert not any(clean.values())
    v = Verifier({"warmup": 5, "distances": ["link"]}, [(0, direction), (1, direction)])
    flags = run_stage(v, 18, direction, Attacker(parse_attack(f"rank=1,start=12,dir={direction},{attack}"), seed=0))
    late = [e for s in (14, 15) for e in flags[s]]
    assert late and all(e["reasons"] == ["link"] and e["sender"] == 1 for e in late)
    assert v.banned == {1}


def test_predictors_forgive_a_bounded_gain_not_a_flip_or_other_data() -> None:
    """An honest loss spike left a stage's output where its surrogate pointed at 0.6-0.8 of its
    size (d=256, lr 1e-3): a link share of 0.35-0.65 that flagged 8 steps. A gain within
    ``PREDICTOR_GAIN`` is forgiven; a sign flip or unrelated rows score as before (>= 1)."""
    from planner.integrity import predictors as pred

    gen = torch.Generator().manual_seed(4)
    x, weights = torch.randn(256, 16, generator=gen), torch.randn(17, 16, generator=gen)
    guess = torch.cat((x, torch.ones(256, 1)), dim=1) @ weights
    share = {name: (lambda num, den, _: num / den)(*pred.link_parts(x, y, weights))
             for name, y in (("gain", 0.7 * guess), ("flip", -guess), ("other", torch.randn(256, 16, generator=gen)))}
    assert share["gain"] < 1e-6 and share["flip"] > 2.0 and share["other"] > 1.0
    labels, table, centre = torch.arange(64) % 8, torch.randn(8, 16, generator=gen), torch.zeros(16)
    rows = 0.6 * table[labels] + 0.1 * torch.randn(64, 16, generator=gen)
    num, den = pred.binding_parts(rows, labels, table, torch.ones(8), centre)
    assert num / den < 0.05
    num, den = pred.binding_parts(-rows, labels, table, torch.ones(8), centre)
    assert num / den > 1.0


def test_a_surrogate_that_explains_the_output_overrules_the_distribution_tests() -> None:
    """The distribution tests alone cannot tell an honest shift (a spike that moved one stage's
    gradient spectrum for good, d=256, lr 1e-3) from corruption; an output the stage's surrogate
    predicts from its input can. The scale test and the link itself are never overruled."""
    mon = Verifier({"warmup": 0}, [(0, "act")]).monitor(0, "act")
    mon.first_step = 0
    for value in (0.05, 0.06, 0.07, 0.08) * 4:
        for name in mon.fences:
            mon.fences[name].update(value)
    assert mon.exceeded({"spectral": 0.5, "sign": 0.9, "link": 0.05}, 20) == ()
    assert mon.exceeded({"spectral": 0.5, "link": 0.25}, 20) == ("spectral",)   # the surrogate is not sure
    assert mon.exceeded({"spectral": 0.5}, 20) == ("spectral",)                 # no surrogate: no voucher
    assert mon.exceeded({"spectral": 0.5, "scale": 1.5, "link": 0.05}, 20) == ("spectral", "scale")


def run_scaled_stage(input_efolds: float, output_efolds: float, *, at: int = 14) -> list[tuple[int, int, tuple]]:
    """A near-linear stage checked on both sides; at step ``at`` its input grows by
    ``input_efolds`` e-folds and its output by ``output_efolds``. Returns the output's flags."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(16, 16, generator=gen) / 4
    v = Verifier({"warmup": 8}, [(0, "act"), (1, "act")])
    flags = []
    for step in range(at + 1):
        for mb in range(MBS):
            x = torch.randn(64, 16, generator=gen) * 2 + 1
            y = x + 0.3 * torch.tanh(x @ weight)
            if step == at:
                x, y = x * math.exp(input_efolds), y * math.exp(output_efolds)
            v.check(0, "act", x, step=step, mb=mb, sender=0)
            verdict = v.check(1, "act", y, step=step, mb=mb, sender=1)
            flags += [(step, mb, verdict.reasons)] if verdict.flagged else []
        events = v.flag_events(step)
        flags += [(step, e["mb"], tuple(e["reasons"])) for e in events if e["boundary"] == 1]
        v.end_step(step, [events])
    return flags


def test_scale_is_the_stage_s_own_share_of_the_size_change() -> None:
    """A loss spike's gradients grow through every stage, each amplifying what it received
    (d=256, lr 1e-3: input +1.1, output +2.1 e-folds); the scale test reads the stage's own
    share per e-fold its input moved (``gain``). A sender that rescales what it sends is still caught."""
    assert run_scaled_stage(0.0, 0.0) == []
    assert run_scaled_stage(1.1, 2.1) == []                   # absolute: 2.1 e-folds, twice the floor
    assert all("gain" in reasons for _, _, reasons in run_scaled_stage(0.0, 3.0)) and run_scaled_stage(0.0, 3.0)


# ---------------------------------------------------------------------------- the link's residual and its drift

def run_residual_stage(noise: float, *, start: int = 16, steps: int = 24, growth: float = 1.0
                       ) -> tuple[Verifier, list[tuple]]:
    """A stage whose nonlinearity lives in 3 of 16 directions; from ``start`` its sender adds
    isotropic noise of ``noise`` times the output's std (times ``growth`` per step after
    ``start``: a creep the references would follow). Returns the verifier and
    ``(step, mb, reasons)`` of every flag on the stage's output. (The warm-up covers the
    steps in which the verifier's linear surrogate of the stage still converges.)"""
    gen = torch.Generator().manual_seed(0)
    d = 16
    weight, u = torch.randn(d, d, generator=gen) / d ** 0.5, torch.randn(d, 3, generator=gen)
    v = Verifier({"warmup": 8}, [(0, "act"), (1, "act")])
    flags = []
    for step in range(steps):
        for mb in range(MBS):
            x = torch.randn(64, d, generator=gen) * 2 + 1
            y = x + 0.5 * torch.tanh(x @ weight) @ (u @ u.T) / 3
            if step >= start:
                y = y + noise * growth ** (step - start) * y.std() * torch.randn(y.shape, generator=gen)
            v.check(0, "act", x, step=step, mb=mb, sender=0)
            verdict = v.check(1, "act", y, step=step, mb=mb, sender=1)
            if verdict.flagged:
                flags.append((step, mb, verdict.reasons))
        events = v.flag_events(step)
        flags += [(step, e["mb"], tuple(e["reasons"])) for e in events if e["scope"] == "step" and e["boundary"] == 1]
        v.end_step(step, [events])
    return v, flags


def test_residual_shape_catches_noise_the_link_share_cannot_see() -> None:
    v, flags = run_residual_stage(0.0)
    assert flags == [] and v.banned == set()
    v, flags = run_residual_stage(0.05)              # 0.25% of the output's energy
    assert flags and all(step >= 16 and "link" not in reasons for step, _, reasons in flags)
    # One test a little over its fence does not drop a sample (``evidence.GROSS``): the step's
    # average, held closer, blames the sender at the attack's first step.
    assert [(mb, reasons) for step, mb, reasons in flags if step == 16] == [(STEP_MB, ("residual",))]
    assert v.banned == {1}


def test_one_test_a_little_over_its_fence_holds_a_sample_instead_of_dropping_it() -> None:
    """Honest training puts one of a dozen tests (or two related ones) a little over its fence now
    and then; corruption puts them far over (see ``evidence.GROSS``), or keeps them there (the
    step's average). A replay over its fence is a copy: proof alone."""
    from planner.integrity.evidence import GROSS

    mon = Verifier({"warmup": 0}, [(0, "act")]).monitor(0, "act")
    mon.first_step = 0
    for value in (0.05, 0.06, 0.07, 0.08) * 4:
        for name in mon.fences:
            mon.fences[name].update(value)
    link, residual = mon.fences["link"].fence(), mon.fences["residual"].fence()
    assert mon.exceeded({"link": 1.5 * link, "residual": 0.5 * residual}, 20) == ()
    assert mon.exceeded({"link": GROSS * link}, 20) == ("link",)
    # several tests over their fences drop it when their excesses multiply to GROSS (related tests
    # a little over are one excess counted twice)
    assert mon.exceeded({"link": 1.5 * link, "residual": 1.1 * residual}, 20) == ()
    assert mon.exceeded({"link": 1.5 * link, "residual": 1.7 * residual}, 20) == ("link", "residual")
    assert mon.exceeded({"replay": 1.01 * mon.fences["replay"].fence()}, 20) == ("replay",)
    # The step's average is judged on its own fences, one test enough; before they have their
    # ``min_samples`` steps, on the per-sample ones.
    assert mon.exceeded({"link": 1.5 * link}, 20, per_sample=False) == ("link",)
    assert mon.exceeded({"link": 0.9 * link}, 20, per_sample=False) == ()
    for value in (0.05, 0.06, 0.07, 0.08) * 4:
        for name in mon.step_fences:
            mon.step_fences[name].update(value)
    assert mon.exceeded({"link": 1.5 * mon.step_fences["link"].fence()}, 20, per_sample=False) == ("link",)


def run_noisy_stage(steps: int, attacker: Attacker | None) -> tuple[Verifier, dict[int, list[dict]]]:
    """A stage whose output the linear surrogate explains only roughly (link share ~0.17, like
    gpt-tiny's ~0.1-0.17): its link fence stands at ``ratio`` times that, and the output of
    another batch scores between the fence and ``GROSS`` times it: held, not dropped."""
    gen = torch.Generator().manual_seed(5)
    mix = torch.randn(16, 16, generator=gen) / 4
    v = Verifier({"warmup": 5, "distances": ["link"]}, [(0, "act"), (1, "act")])
    flags = {}
    for step in range(steps):
        for mb in range(MBS):
            x = torch.randn(64, 16, generator=gen)
            y = x + torch.tanh(x @ mix) + 0.5 * torch.randn(64, 16, generator=gen)
            if attacker is not None:
                y = attacker.apply(y, direction="act", step=step, mb=mb)
            v.check(0, "act", x, step=step, mb=mb, sender=0)
            v.check(1, "act", y, step=step, mb=mb, sender=1)
        flags[step] = v.flag_events(step)
        v.end_step(step, [flags[step]])
    return v, flags


def test_held_samples_are_judged_before_the_step_fences_fill() -> None:
    """A step's own fences learn one score per step (ready ``min_samples`` steps after the
    warm-up); until then the per-sample fences judge its average. Before, every held sample was
    folded in unjudged: a stale worker starting right after the warm-up (gpt-tiny, link share
    1.0-1.5 against a fence of 0.6) taught the link fence and the surrogate its own outputs
    within two steps (fence 0.6 -> 4.4) and was never flagged again."""
    v, flags = run_noisy_stage(16, None)
    assert not any(flags.values()) and v.banned == set()
    v, flags = run_noisy_stage(16, Attacker(parse_attack("rank=1,start=6,kind=delay,steps=2"), seed=0))
    assert not v.monitor(1, "act").step_fences["link"].ready      # judged on the per-sample fence
    assert all(any(e["reasons"] == ["link"] and e["sender"] == 1 for e in flags[s]) for s in range(6, 16))
    assert v.banned == {1} and next(e for e in v.events if e["type"] == "ban")["step"] == 10
    assert v.monitor(1, "act").fences["link"].fence() < 1.0       # it learnt no stale output


def test_drift_catches_a_sender_that_keeps_every_sample_inside_its_fence() -> None:
    # Noise creeping up 20% a step: every sample stays under the fences it is scored against
    # (they follow the creep), the drift's baseline does not (only passing steps teach it,
    # and not those that already look out of control). Its baseline is one score per step:
    # it needs a stretch of settled training (the attack starts 22 steps after the warm-up).
    v, flags = run_residual_stage(0.02, start=30, steps=40, growth=1.2)
    assert flags and flags[0][1:] == (STEP_MB, ("drift",))
    assert 30 <= flags[0][0] <= 38 and v.banned == {1}


def test_drift_counts_a_step_once_however_many_microbatches_share_its_excursion() -> None:
    """The microbatches of a step share the weights, the surrogate and the whitener, so an
    honest step's residual scores move together (a stage whose shape changed faster than
    the whitener follows, a row subset's noise): here each step's residual energy off the
    nonlinearity's 3 directions has a random size shared by its 8 microbatches (up to ~2x
    the baseline, for a step or two at a time). Counted once per step, that is noise
    around the baseline; counted per microbatch, it summed 8 times and banned the sender."""
    gen = torch.Generator().manual_seed(1)
    d, mbs = 16, 8
    weight, u = torch.randn(d, d, generator=gen) / d ** 0.5, torch.randn(d, 3, generator=gen)
    v = Verifier({"warmup": 8}, [(0, "act"), (1, "act")])
    for step in range(60):
        spill = 0.02 * float(torch.rand(1, generator=gen)) ** 2     # this step's shared excursion
        for mb in range(mbs):
            x = torch.randn(64, d, generator=gen) * 2 + 1
            y = x + 0.5 * torch.tanh(x @ weight) @ (u @ u.T) / 3
            y = y + spill * y.std() * torch.randn(y.shape, generator=gen)
            v.check(0, "act", x, step=step, mb=mb, sender=0)
            v.check(1, "act", y, step=step, mb=mb, sender=1)
        v.end_step(step, [v.flag_events(step)])
    drift = [e for e in v.events if e["type"] == "flag" and "drift" in e["reasons"]]
    assert drift == [] and v.banned == set()


def test_eigendecompositions_are_redone_every_basis_refresh_steps(monkeypatch) -> None:
    from planner.integrity import distances

    calls = []
    original = distances.principal_basis
    monkeypatch.setattr(distances, "principal_basis", lambda cov: calls.append(1) or original(cov))
    for refresh, expected in ((1, 11), (4, 3)):
        calls.clear()
        run(Verifier({"warmup": 5, "basis_refresh": refresh}, [(0, "act")]), 12)
        assert len(calls) == expected                 # one per step after the first, or one per 4 of them


def test_verify_hooks_hand_the_monitors_the_microbatch_labels() -> None:
    from types import SimpleNamespace

    from models.data import ByteTextDataset
    from planner.integrity.hooks import _Labels

    plan = SimpleNamespace(model=SimpleNamespace(spec="gpt-tiny", seq=None),
                           config=SimpleNamespace(microbatch_size=2, global_batch=8))
    labels = _Labels(plan, seed=3, data="auto")
    idx, targets = ByteTextDataset(32).batch(5, 8, 3)
    assert torch.equal(labels.of(5, 1, "act"), idx[2:4])          # activations carry their tokens
    assert torch.equal(labels.of(5, 1, "grad"), targets[2:4])     # gradients their targets


def test_a_verifiers_bans_and_blame_history_survive_a_checkpoint() -> None:
    v = Verifier({}, [(1, "act")])
    for s in range(5):
        v.end_step(s, [[flag(s, 0, 1, "act", 2), flag(s, 1, 1, "act", 2)]])
    v.end_step(5, [[flag(5, 0, 1, "act", 3)]])                     # a lone flag, carried to the next step
    again = Verifier({}, [(1, "act")])
    again.restore_bans(json.loads(json.dumps(v.bans_state())))   # as the checkpoint's JSON carries it
    assert again.banned == {2} and again.summary()["blamed_steps"] == {"2": [0, 1, 2, 3, 4]}
    again.end_step(6, [[flag(6, 2, 1, "act", 3)]])
    assert again.last_blamed == {3}
