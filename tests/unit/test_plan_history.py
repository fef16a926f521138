"""A plan's history and excluded hosts: typed entries, JSON round trip, the effective cluster, and
`replan` recording exclusions and re-admissions."""
from __future__ import annotations

import dataclasses

import pytest
from plan_fixtures import (
    TEST_DEVICE,
    block,
    chain,
    cluster,
    compile_simple,
    golden_plan,
    solution,
)

from planner.api import plan_chain
from planner.replan import replan
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.instruction_costs import CostModel
from planner.plan import Plan
from planner.plan_history import HistoryEntry
from planner.plan_load import load_plan
from planner.solver.policy import VerificationPolicy

WHEN = "2026-12-03T09:00:00Z"
FIRST = HistoryEntry(event="planned", when_utc=WHEN, reason="planned on test")


def _lost(**kw) -> HistoryEntry:
    base = dict(event="failure", when_utc="2026-12-03T10:00:00Z", reason="rank 1 died", excluded_hosts=("spare",),
                previous_ranks=3, previous_step_ms=12.5)
    return HistoryEntry(**{**base, **kw})


@pytest.fixture(scope="module")
def spare_plan() -> Plan:
    """Two stages on h0 and h1 of a three-host cluster; ``spare`` runs nothing."""
    ch = chain([block(i) for i in range(4)])
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1), ("spare", TEST_DEVICE, 1)])
    return compile_simple(ch, cl, solution([(0, 1), (2, 3)], [("h0/0",), ("h1/0",)], 4),
                          VerificationPolicy(enabled=False))


def test_history_and_excluded_hosts_round_trip(spare_plan, tmp_path):
    plan = dataclasses.replace(spare_plan, excluded_hosts=("spare",),
                               history=(FIRST, _lost(excluded_domains=("spare",))))
    assert Plan.from_dict(plan.to_dict()) == plan
    assert load_plan(plan.save(tmp_path / "p.json")) == plan
    assert plan.to_dict()["history"][1]["excluded_hosts"] == ["spare"]


def test_effective_cluster_leaves_out_excluded_hosts(spare_plan):
    plan = dataclasses.replace(spare_plan, excluded_hosts=("spare",))
    assert [h["name"] for h in plan.cluster["hosts"]] == ["h0", "h1", "spare"]  # as given: it can come back
    assert [h.name for h in plan.effective_cluster().hosts] == ["h0", "h1"]
    assert [h.name for h in CostModel.for_plan(plan).cluster.hosts] == ["h0", "h1"]
    assert [h.name for h in spare_plan.effective_cluster().hosts] == ["h0", "h1", "spare"]


@pytest.mark.parametrize("excluded,message", [(("h1",), "ranks on excluded host h1"),
                                              (("nowhere",), "excluded_hosts"),
                                              (("spare", "h0"), "excluded_hosts")])
def test_bad_excluded_hosts(spare_plan, excluded, message):
    with pytest.raises(InvalidInputError, match=message):
        dataclasses.replace(spare_plan, excluded_hosts=excluded)


@pytest.mark.parametrize("change,message", [
    (dict(event="lost"), "history event"),
    (dict(when_utc="2026-12-03 10:00"), "history time"),
    (dict(excluded_hosts=()), "entry 'failure'"),  # a re-plan changes some host
    (dict(previous_ranks=None, previous_step_ms=None), "entry 'failure'"),
    (dict(event="readmit"), "readmit exactly when"),
    (dict(readmitted_hosts=("spare",)), "not both"),
])
def test_bad_history_entries(change, message):
    with pytest.raises(InvalidInputError, match=message):
        _lost(**change)


def test_original_entry_has_no_hosts_or_previous_plan():
    with pytest.raises(InvalidInputError, match="entry 'planned'"):
        HistoryEntry(event="planned", when_utc=WHEN, reason="x", excluded_hosts=("h0",))
    with pytest.raises(InvalidInputError, match="entry 'planned'"):
        HistoryEntry(event="planned", when_utc=WHEN, reason="x", previous_ranks=2, previous_step_ms=1.0)


def test_summary_is_one_line_with_what_why_and_before():
    line = _lost(event="ban", excluded_domains=("vol3",), reason="flagged 9 times").summary()
    assert line == ("2026-12-03T10:00:00Z ban: excluded spare (domain vol3); flagged 9 times "
                    "(was 3 ranks, simulated step 12.500 ms)")
    assert "\n" not in line and FIRST.summary() == f"{WHEN} planned: planned on test"


def test_the_golden_plan_carries_its_first_entry():
    assert golden_plan().history == (dataclasses.replace(FIRST, when_utc="2026-01-01T00:00:00Z"),)


# --- replan -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def first() -> Plan:
    ch = chain([block(i) for i in range(4)])
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1), ("h2", TEST_DEVICE, 1)])
    return plan_chain(ch, cl, spec="tests:toy", global_batch=8, policy=VerificationPolicy(enabled=False),
                      time_limit_s=1.0, workers=1)


def test_a_fresh_plan_starts_its_history(first):
    (entry,) = first.history
    assert entry.event == "planned" and entry.previous_ranks is None and first.excluded_hosts == ()


@pytest.fixture(scope="module")
def second(first) -> Plan:
    return replan(first, exclude_hosts=["h2"], reason="rank died", time_limit_s=1.0, workers=1)


def test_replan_excludes_then_readmits(first, second):
    assert second.excluded_hosts == ("h2",) and second.cluster == first.cluster
    assert "h2" not in {r.host for r in second.ranks}
    assert [h.name for h in second.effective_cluster().hosts] == ["h0", "h1"]
    lost = second.history[-1]
    assert (lost.event, lost.excluded_hosts, lost.reason) == ("failure", ("h2",), "rank died")
    assert (lost.previous_ranks, lost.previous_step_ms) == (first.num_ranks, first.predicted.step_ms)
    third = replan(second, readmit_hosts=["h2"], reason="banned by mistake", time_limit_s=1.0, workers=1)
    assert third.excluded_hosts == () and [h.name for h in third.effective_cluster().hosts] == ["h0", "h1", "h2"]
    assert [e.event for e in third.history] == ["planned", "failure", "readmit"]
    assert third.history[-1].readmitted_hosts == ("h2",) and third.history[-1].previous_ranks == second.num_ranks
    assert third.report.notes[0].startswith("replanned with h2 re-admitted: banned by mistake")


@pytest.mark.parametrize("kw,message", [
    (dict(readmit_hosts=["h1"]), "readmit host 'h1'.*not excluded"),
    (dict(readmit_hosts=["h9"]), "readmit host 'h9'"),
    (dict(exclude_hosts=["h2"]), "excluded already"),
    (dict(exclude_hosts=["h1"], readmit_hosts=["h1"]), "not excluded"),
    (dict(exclude_domains=["h2"], readmit_hosts=["h2"]), "excluded or re-admitted"),
    (dict(exclude_domains=["h2"]), "at least one host"),  # its only host is out already
    (dict(), "at least one host"),
])
def test_bad_host_changes(second, kw, message):
    with pytest.raises(InvalidInputError, match=message):
        replan(second, reason="x", time_limit_s=0.5, workers=1, **kw)


def test_excluding_every_host_is_infeasible(first):
    with pytest.raises(InfeasiblePlanError, match="every host"):
        replan(first, exclude_domains=["h0", "h1", "h2"], reason="x", time_limit_s=0.5, workers=1)
