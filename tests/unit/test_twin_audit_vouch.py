"""An audit outranks the statistics (issue 37): a flag of a tensor whose audit passed is withdrawn, so an honest
twin audited on every microbatch is never banned by the monitors alone (``verification_twins.py``, 1 in 2, attack
at 40, seed 2: after the deeper rollback the twin's gradient step means failed the sign test alone, every
microbatch audited and passing, and it was banned at 60)."""
from __future__ import annotations

import torch

from planner.integrity.blame import STEP_MB
from planner.integrity.verifier import Verifier
from planner.verifier_config import VerifierConfig

TWIN = 3
FLIP_FROM = 12   # from here on, every other step's gradient mean is mirrored: a step-level sign failure alone


def _run(audited_mbs: tuple[int, ...], steps: int = 30) -> tuple[Verifier, list[list[dict]]]:
    """The twin alone on its stage (two microbatches a step), its boundary-0 gradients checked; every step's
    audits of ``audited_mbs`` recorded as passed before the step's flags are taken (as an inline audit is)."""
    v = Verifier(VerifierConfig().to_dict(), [(0, "grad")], stage_of={TWIN: 1}, microbatches={TWIN: 2})
    gen = torch.Generator().manual_seed(0)
    mean = 0.1 * torch.randn(32, generator=gen)
    flags = []
    for step in range(steps):
        sign = -1.0 if step >= FLIP_FROM and step % 2 == 0 else 1.0
        for mb in range(2):
            v.check(0, "grad", sign * mean + torch.randn(4, 16, 32, generator=gen), step=step, mb=mb, sender=TWIN)
            if mb in audited_mbs:
                v.record_audit(TWIN, step, passed=True, mb=mb, boundary=0, direction="grad")
        events = v.flag_events(step)
        v.end_step(step, [events])
        flags.append(events)
    return v, flags


def test_without_audits_the_mirrored_step_means_ban_the_sender():
    v, flags = _run(())
    assert [e["reasons"] for e in flags[FLIP_FROM]] == [["sign"]] and flags[FLIP_FROM][0]["mb"] == STEP_MB
    assert TWIN in v.banned


def test_a_step_every_sample_of_which_passed_its_audit_is_not_flagged_and_the_twin_is_never_banned():
    v, flags = _run((0, 1))
    assert not any(flags) and not v.banned and not v.unresolved()
    assert v.monitor(0, "grad").vouched >= 1   # its step failed the statistics; the audits vouched for it


def test_a_step_with_an_unaudited_sample_still_fails():
    v, flags = _run((0,))
    assert [e["reasons"] for e in flags[FLIP_FROM]] == [["sign"]]
    assert TWIN in v.banned


def test_a_passed_audit_withdraws_the_microbatch_flag_of_that_very_tensor_only():
    v = Verifier(VerifierConfig().to_dict(), [(0, "grad")], stage_of={TWIN: 1}, microbatches={TWIN: 2})
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        gross = 30.0 if step == 11 else 1.0   # both of step 11's gradients 30 times their size
        for mb in range(2):
            verdict = v.check(0, "grad", gross * torch.randn(4, 16, 32, generator=gen), step=step, mb=mb, sender=TWIN)
            assert verdict.flagged == (step == 11)
        if step == 11:
            v.record_audit(TWIN, step, passed=True, mb=0, boundary=0, direction="grad")
            v.record_audit(TWIN, step, passed=True, mb=1, boundary=1, direction="act")   # another tensor of mb 1
        events = v.flag_events(step)
    assert [e["mb"] for e in events] == [1]
    assert v.summary()["audits"]["refuted_flags"] == 1


def test_a_passed_audit_never_withdraws_a_flag_laid_on_the_stages_input_nor_an_audits_own():
    v = Verifier(VerifierConfig().to_dict(), [(0, "grad")], stage_of={TWIN: 1}, microbatches={TWIN: 2})
    laid = {"type": "flag", "step": 4, "mb": 0, "boundary": 0, "direction": "grad", "sender": TWIN,
            "scope": "microbatch", "scores": {"link": 9.0}, "fences": {"link": 1.0}, "reasons": ["link"], "upstream": 0}
    failed = {**laid, "scores": {"audit": 1.0}, "fences": {"audit": 0.01}, "reasons": ["audit"]}
    del failed["upstream"]
    v.add_flags(4, [laid, failed])
    v.record_audit(TWIN, 4, passed=True, mb=0, boundary=0, direction="grad")
    assert v.flag_events(4) == [laid, failed]
