"""Dropped microbatches: named from the verifiers' flags and the trusted count of what trained, read from
the lead verifier's record only, summed up in one line, and more than 1% of them is a distinct exit."""
from __future__ import annotations

from types import SimpleNamespace

from planner.integrity.drops import TAINTED_BY_SENDER, step_drops
from planner.runtime.outputs.drops import DROPS_EXIT_CODE, drops_line, too_many_drops
from planner.runtime.outputs.run_report import lead_drops


def _flag(mb, boundary, direction, sender, reasons, *, step=4, scope="microbatch"):
    return {"type": "flag", "step": step, "mb": mb, "boundary": boundary, "direction": direction, "sender": sender,
            "scope": scope, "scores": {}, "fences": {}, "reasons": reasons}


def test_each_flagged_microbatch_is_named_once_by_its_most_upstream_flag():
    flags = [[_flag(1, 1, "act", 2, ["link"]), _flag(1, 0, "act", 1, ["sign", "swd"])],
             [_flag(0, 0, "grad", 1, ["scale"]), _flag(-1, 1, "act", 2, ["spectral"], scope="step"),
              _flag(3, 0, "act", 1, ["mad"], step=5)]]
    drops = step_drops(4, flags, dropped=2)
    assert drops == [
        {"step": 4, "microbatch": 0, "boundary": 0, "direction": "grad", "sender": 1, "reason": "flagged: scale"},
        {"step": 4, "microbatch": 1, "boundary": 0, "direction": "act", "sender": 1, "reason": "flagged: sign, swd"}]


def test_drops_no_flag_explains_are_a_senders_own_taint():
    drops = step_drops(2, [_flag(0, 0, "act", 1, ["mad"], step=2)], dropped=3)
    assert [d["reason"] for d in drops] == ["flagged: mad", TAINTED_BY_SENDER, TAINTED_BY_SENDER]
    assert drops[1]["microbatch"] is None and drops[1]["sender"] is None
    assert step_drops(2, [], dropped=0) == []


def _plan(verifier_ranks):
    return SimpleNamespace(verifiers=[SimpleNamespace(rank=r) for r in verifier_ranks])


def test_only_the_lead_verifiers_record_is_read():
    lie = {"drops": [], "drops_total": 0}
    truth = {"drops": [{"step": 0, "microbatch": 0, "boundary": 0, "direction": "act", "sender": 1,
                        "reason": "flagged: mad"}], "drops_total": 1}
    ranks = [{"rank": 0, "verification": {}}, {"rank": 1, "verification": lie}, {"rank": 2, "verification": truth},
             {"rank": 3, "verification": {**truth, "drops_total": 99}}]
    drops, total = lead_drops(_plan([3, 2]), SimpleNamespace(verify=True), ranks)
    assert (drops, total) == (truth["drops"], 1)
    assert lead_drops(_plan([2]), SimpleNamespace(verify=False), ranks) == ([], 0)


def test_the_drops_line_and_the_one_percent_limit():
    drops = [{"reason": "flagged: scale"}] * 2 + [{"reason": "flagged: mad"}]
    result = {"microbatches": 300, "drops": drops, "drops_total": 3}
    assert drops_line(result) == "dropped 3 of 300 microbatches (1.00%), by reason: flagged: scale x2; flagged: mad x1"
    assert not too_many_drops(result)       # 1% exactly keeps exit 0
    assert too_many_drops({**result, "drops_total": 4}) and DROPS_EXIT_CODE not in (0, 1, 2)
    assert drops_line({"microbatches": 300, "drops": [], "drops_total": 0}) == "dropped 0 of 300 microbatches (0.00%)"
    assert drops_line({"microbatches": 0}) is None and not too_many_drops({"microbatches": 0, "drops_total": 0})
