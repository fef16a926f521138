"""The distributed verification benchmark's arithmetic on a run report: watch-only copies are not checks, and the
precision/recall of drops and the attacker's ban delay come from the verifiers' events and the attacker's log."""
from __future__ import annotations

import math

from benchmarks.verification_dist import attack_metrics, summarize


def monitor(boundary: int, direction: str, checked: int, flagged: int = 0) -> dict:
    return {"boundary": boundary, "direction": direction, "checked": checked, "flagged": flagged, "step_flags": 0,
            "tainted": 0}


def flag(step: int, mb: int, sender: int, scope: str = "microbatch") -> dict:
    return {"type": "flag", "step": step, "mb": mb, "boundary": 1, "direction": "act", "sender": sender,
            "scope": scope, "reasons": ["mad", "l2"]}


PLAN = {"verifiers": [{"rank": 3, "boundary": 0, "directions": ["act", "grad"], "watch_only": ["act"]},
                      {"rank": 3, "boundary": 1, "directions": ["act", "grad"], "watch_only": []}]}


def report(events: list[dict], attacked: list[list]) -> dict:
    verifier = {"monitors": [monitor(0, "act", 40, flagged=0), monitor(0, "grad", 40),
                             monitor(1, "act", 40, flagged=3), monitor(1, "grad", 40)],
                "blamed_steps": {"1": [20, 21]}, "events": events, "events_total": len(events),
                "config": {"ban_honest_rate": 0.05, "ban_attack_rate": 0.6, "ban_false_steps": 1e5, "warmup": 2}}
    ranks = [{"rank": r, "verification": verifier if r == 3 else {}, "attacked": attacked if r == 1 else []}
             for r in range(4)]
    return {"ranks": ranks, "steps": 22, "dropped": [0] * 20 + [2, 1], "banned": [1], "final_loss": 3.0,
            "measured_step_ms": 500.0}


def test_watch_only_monitors_are_not_counted_as_checks_and_bans_come_from_the_events():
    events = [flag(20, 0, 1), flag(20, 1, 1), flag(21, 5, 1), flag(21, -1, 1, scope="step"),
              {"type": "ban", "step": 21, "sender": 1, "first_flagged_step": 20, "evidence": 12.0}]
    row = summarize(report(events, []), PLAN)
    assert row["checks"] == 120 and row["flags_microbatch"] == 3            # boundary 0's act is watch-only
    assert row["fpr_per_sample"] == 0.025 and row["dropped"] == 3 and row["flagged_steps"] == [20, 21]
    assert row["bans"] == [{"sender": 1, "step": 21, "first_flagged_step": 20, "evidence": 12.0}]
    assert row["blamed_pairs"] == 2 and not row["events_truncated"] and row["blame_rate"] == {"1": 0.1}
    assert row["peak_evidence"] == {"1": round(2 * math.log(0.6 / 0.05), 2)} and row["ban_level"] == 11.51


def test_drops_are_scored_against_the_attacked_microbatches_and_the_ban_against_the_start():
    events = [flag(20, 0, 1), flag(20, 1, 1), flag(21, 5, 1), flag(21, -1, 1, scope="step"),
              {"type": "ban", "step": 21, "sender": 1, "first_flagged_step": 20, "evidence": 12.0}]
    attacked = [[20, 0, "act", "scale"], [20, 1, "act", "scale"], [20, 2, "act", "scale"], [21, 0, "act", "scale"]]
    rep = report(events, attacked)
    row = summarize(rep, PLAN)
    got = attack_metrics(rep, row, attacker=1, start=20, microbatches=8)
    # dropped {(20,0),(20,1),(21,5)} vs attacked {(20,0),(20,1),(20,2),(21,0)}: 2 hits
    assert got["precision"] == round(2 / 3, 4) and got["recall"] == 0.5 and got["f1"] == round(4 / 7, 4)
    assert got["false_drops"] == 1 and got["missed_microbatches"] == 2
    assert got["attacker_ban_step"] == 21 and got["ban_delay_steps"] == 1 and got["honest_banned"] == []
    assert got["goal"] and not got["goal_f1"] and got["pr_from"] == "events"
    honest = attack_metrics(rep, row, attacker=2, start=20, microbatches=8)   # rank 1 banned, 2 the attacker
    assert honest["attacker_ban_step"] is None and not honest["goal"] and honest["honest_banned"][0]["sender"] == 1


def test_with_flags_missing_from_the_events_a_whole_step_attack_is_scored_from_the_drops_per_step():
    events = [flag(21, 5, 1)]                       # the report kept only the latest event: 3 flags were counted
    attacked = [[s, mb, "act", "noise"] for s in (20, 21) for mb in range(2)]
    rep = report(events, attacked)
    rep["dropped"] = [0] * 19 + [1, 2, 1]           # one false drop at step 19, three of the four attacked
    rep["steps"] = 22
    rep["ranks"][3]["verification"]["events_total"] = 4
    row = summarize(rep, PLAN)
    got = attack_metrics(rep, row, attacker=1, start=20, microbatches=2)
    assert got["pr_from"] == "counts" and got["dropped_counted"] == 4 and got["false_drops"] == 1
    assert got["precision"] == 0.75 and got["recall"] == 0.75
    partial = attack_metrics(rep, row, attacker=1, start=20, microbatches=4)   # attacked 2 of 4 per step
    assert partial["pr_from"] == "unavailable" and partial["f1"] is None and not partial["goal_f1"]


def test_the_model_keeps_out_what_was_dropped_and_what_the_recovery_undid():
    events = [flag(10, 3, 2), flag(21, 5, 1), flag(21, -1, 1, scope="step"),
              {"type": "ban", "step": 21, "sender": 1, "first_flagged_step": 20, "evidence": 12.0}]
    attacked = [[s, mb, "act", "scale"] for s in (19, 20, 21) for mb in (0, 1)]
    rep = report(events, attacked)
    rep["ranks"][3]["verification"]["monitors"][2]["flagged"] = 2      # every microbatch flag is in the events
    got = attack_metrics(rep, summarize(rep, PLAN), attacker=1, start=19, microbatches=8)
    # undone from step 20 on: 4 of the 6 attacked; (19, *) kept; (10, 3) lost for good, (21, 5) replayed
    assert got["rollback_step"] == 20 and got["honest_lost"] == 1
    assert got["model_recall"] == round(4 / 6, 4) and got["model_precision"] == 0.8
    assert got["model_f1"] == round(8 / 11, 4) and not got["goal_model_f1"]
    no_ban = report([flag(20, 0, 1)], [[20, 0, "act", "scale"], [21, 0, "act", "scale"]])
    no_ban["ranks"][3]["verification"]["monitors"][2]["flagged"] = 1
    none = attack_metrics(no_ban, summarize(no_ban, PLAN), attacker=1, start=20, microbatches=8)
    assert none["rollback_step"] == 22 and none["model_recall"] == 0.5 and none["model_precision"] == 1.0


def test_a_whole_step_attack_scored_from_counts_keeps_out_every_step_from_the_rollback():
    events = [flag(21, 5, 1), {"type": "ban", "step": 21, "sender": 1, "first_flagged_step": 21, "evidence": 12.0}]
    attacked = [[s, mb, "act", "noise"] for s in (20, 21) for mb in range(2)]
    rep = report(events, attacked)
    rep["dropped"] = [0] * 19 + [1, 1, 1]           # a false drop at 19, one of step 20's attacked, one of 21's
    rep["ranks"][3]["verification"]["events_total"] = 5
    got = attack_metrics(rep, summarize(rep, PLAN), attacker=1, start=20, microbatches=2)
    assert got["pr_from"] == "counts" and got["rollback_step"] == 21 and got["honest_lost"] == 1
    assert got["model_recall"] == 0.75 and got["model_precision"] == 0.75    # step 20's second attacked one kept
