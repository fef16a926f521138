"""The pure parts of the runtime's audits (``planner.runtime.rank.audits``): the applied-gradient digest, the
comparison of a sent tensor with its recompute, and the copy's optimizer step."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from rich.console import Console

from planner.commands.run import summary_table
from planner.errors import ProtocolError
from planner.integrity import audit
from planner.integrity.blame import FLAG_EVENTS_SCHEMA, blame_weights, proven
from planner.runtime.options import RunOptions
from planner.runtime.run_args import add_run_arguments
from planner.runtime.outputs.run_report import (
    RANK_FINAL_SCHEMA,
    audit_counts,
    verifier_sum,
)
from planner.runtime.rank import (
    audit_applied,
    audit_copy,
    audit_inputs,
    audit_state,
    audit_sync,
    audits,
)
from planner.runtime.rank.random_ops import random_op
from planner.runtime.rank.stage import ValueSpec
from planner.runtime.wire import messages
from planner.simulate_audits import audit_site, audited_stages
from planner.solver.audit_price import AuditWhere
from tests.dist.plans import make_plan


def test_the_digest_tells_equal_gradients_from_any_changed_value():
    flat = torch.randn(100)
    assert torch.equal(audit_applied.digest(flat), audit_applied.digest(flat.clone()))
    bumped = flat.clone()
    bumped[37] = torch.nextafter(bumped[37], torch.tensor(math.inf))
    assert not torch.equal(audit_applied.digest(flat), audit_applied.digest(bumped))
    assert audit_applied.digest(None).tolist() == [0] * (1 + audit_applied.DIGEST_WORDS)
    assert audit_applied.digest(flat)[0] == 1 and audit_applied.digest(flat).dtype == torch.int64


def test_the_error_is_relative_and_infinite_for_another_shape_or_other_non_finite_values():
    x = torch.randn(4, 8)
    assert audits._error([x], [x.clone()]) == 0.0
    assert math.isclose(audits._error([0.5 * x], [x]), 0.5, rel_tol=1e-6)
    assert audits._error([x[:2]], [x]) == math.inf
    assert audits._error([x], [x, x]) == math.inf
    ids = torch.arange(8)
    assert audits._error([ids], [ids.clone()]) == 0.0 and audits._error([ids + 1], [ids]) == math.inf


def test_nan_where_the_recompute_has_nan_is_no_failure_but_nan_anywhere_else_is():
    x = torch.randn(16)
    bad = x.clone()
    bad[3] = math.nan
    assert audits._error([bad], [bad.clone()]) == 0.0          # poisoned weights: every replica and the copy alike
    assert audits._error([bad], [x]) == math.inf               # the replica alone sent nan
    assert audits._error([x], [bad]) == math.inf               # it hid the copy's nan
    damped = 0.5 * bad                                         # the finite values still compared
    assert math.isclose(audits._error([damped], [bad]), 0.5, rel_tol=1e-6)


def test_the_copy_steps_only_the_parameters_the_replicas_stepped():
    class Runtime:
        def __init__(self):
            self.module = torch.nn.Linear(3, 2)

        def parameters(self):
            return tuple(self.module.named_parameters())

    runtime = Runtime()
    weight, bias = (p.detach().clone() for p in runtime.module.parameters())
    copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0))
    assert copy.flat_size == 6 + 2 + 2
    flat = torch.cat([torch.ones(6), torch.ones(2), torch.tensor([1.0, 0.0])])   # the bias idle this step
    copy.apply(flat)
    torch.testing.assert_close(runtime.module.weight.detach(), weight - 1.0)
    torch.testing.assert_close(runtime.module.bias.detach(), bias)
    copy.apply(None)   # the replicas took no step (fp16 overflow, nothing trained)
    torch.testing.assert_close(runtime.module.weight.detach(), weight - 1.0)


def _watched_plan(every: int):
    """mlp-tiny in 3 stages, the middle one on two untrusted replicas (ranks 1, 2), rank 0 verifying both of its
    boundaries; the plan audits stage 1 at one in ``every`` microbatches (0: not at all)."""
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (4, 4)}, untrusted=(1, 2), verifiers=[(0, 0, ("act", "grad")), (1, 0, ("act", "grad"))])
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, audit_every=every if s.index == 1 else 0)
                                                  for s in plan.stages))


def test_without_audit_every_a_run_audits_the_stage_the_plan_audits():
    (st,) = audit_state.audited_stages(_watched_plan(4), every=None, verifying=True).values()
    # rank 0 verifies stage 1's outputs: its auditor; no replica trusted: the lowest sends its gradient whole
    assert (st.stage, st.replicas, st.auditor, st.source, st.every) == (1, (1, 2), 0, 1, 4)
    assert audit_state.audited_stages(_watched_plan(8), every=None, verifying=True)[1].every == 8


def test_without_audit_every_a_run_does_not_audit_a_stage_the_plan_does_not():
    # 0: the planner chose no audits there (too dear), or the plan predates them
    assert audit_state.audited_stages(_watched_plan(0), every=None, verifying=True) == {}


def test_an_explicit_audit_every_overrides_the_plans_choice_on_every_watched_stage():
    assert audit_state.audited_stages(_watched_plan(0), every=2, verifying=True)[1].every == 2
    assert audit_state.audited_stages(_watched_plan(8), every=2, verifying=True)[1].every == 2
    assert audit_state.audited_stages(_watched_plan(8), every=0, verifying=True) == {}
    assert audit_state.audited_stages(_watched_plan(8), every=None, verifying=False) == {}


def test_run_audit_every_defaults_to_the_plans_choice():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    assert parser.parse_args(["p.json"]).audit_every is None and RunOptions(plan="p.json").audit_every is None
    assert parser.parse_args(["p.json", "--audit-every", "0"]).audit_every == 0


def _three_stages(*, replicated: int, untrusted, verifiers, every: int = 4):
    """mlp-tiny in 3 stages, stage ``replicated`` on two replicas, a CPU verifier host (device 4) after them."""
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={replicated: (4, 4)}, untrusted=untrusted, verifiers=verifiers, verifier_host=True)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, audit_every=every) for s in plan.stages))


BOTH = ("act", "grad")


@pytest.mark.parametrize("why, replicated, untrusted, verifiers", [
    ("the first stage: its input is data", 0, (0, 1), [(0, 4, BOTH)]),
    ("fed by an untrusted stage, its auditor one of its replicas", 1, (0, 1, 2), [(0, 4, BOTH), (1, 1, BOTH)]),
    ("its auditor is one of its replicas", 1, (1, 2), [(0, 4, BOTH), (1, 1, BOTH)]),
])
def test_the_runtime_never_audits_a_stage_the_planners_rule_rules_out(why, replicated, untrusted, verifiers):
    plan = _three_stages(replicated=replicated, untrusted=untrusted, verifiers=verifiers)
    assert audit_state.audited_stages(plan, every=4, verifying=True) == {}, why
    assert audited_stages(plan) == {}, why   # the simulator neither
    assert all(isinstance(audit_site(plan, k), str) for k in range(plan.num_stages)), why


def test_the_runtime_audits_where_the_simulator_does_and_as_the_planners_rule_says():
    plan = _three_stages(replicated=1, untrusted=(1, 2), verifiers=[(0, 4, BOTH), (1, 4, BOTH)])
    (st,) = audit_state.audited_stages(plan, every=None, verifying=True).values()
    where = audit_site(plan, 1)
    assert isinstance(where, AuditWhere) and (where.auditor, where.source, where.grads) == (4, 1, True)
    assert (st.stage, st.auditor, st.source, st.every) == (1, 4, 1, 4)
    assert audited_stages(plan) == {1: (4, 1, True)}


@pytest.mark.parametrize("stage, codec", [(0, "int8"), (1, "fp8"), (1, "int4")])
def test_the_runtime_does_not_audit_a_stage_whose_boundary_is_compressed(stage, codec):
    plan = _three_stages(replicated=1, untrusted=(1, 2), verifiers=[(0, 4, BOTH), (1, 4, BOTH)])
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, out_codec=codec) if s.index == stage else s
                                                  for s in plan.stages))
    assert audit_state.audited_stages(plan, every=4, verifying=True) == {}
    assert audited_stages(plan) == {}
    assert "encoded" in audit_site(plan, 1)


def _reports(flat, replicas=(1, 2, 3), **lies):
    """Replicas 1 (trusted here or not), 2 and 3 each reporting ``flat``'s digest, but for ``lies``."""
    honest = tuple(audit_applied.digest(flat).tolist())
    return {r: tuple(lies[f"r{r}"].tolist()) if f"r{r}" in lies else honest for r in replicas}


def test_a_trusted_sources_update_is_the_truth_and_its_twin_reporting_another_fails_an_audit():
    flat = torch.randn(10)
    lie = audit_applied.digest(flat + 1)
    judged = audit_applied.judge_applied(_reports(flat, (1, 3), r3=lie), flat, source=1, trusted=frozenset({1}))
    assert judged == audit_applied.AppliedJudgement(stepped=True, suspend=False, liars=(3,))
    # claiming to have taken no step is a lie too; the honest twin is never named
    judged = audit_applied.judge_applied(_reports(flat, (1, 2), r2=audit_applied.digest(None)), flat, source=1,
                                  trusted=frozenset({1}))
    assert judged.liars == (2,) and not judged.suspend and judged.stepped
    assert audit_applied.judge_applied(_reports(flat), flat, source=1, trusted=frozenset({1})) == \
        audit_applied.AppliedJudgement(stepped=True, suspend=False)


def test_with_three_replicas_a_disagreement_with_a_trusted_source_names_nobody():
    """The all-reduce relays partial sums through the replicas: a relaying attacker could frame an honest one."""
    flat = torch.randn(10)
    judged = audit_applied.judge_applied(_reports(flat, r3=audit_applied.digest(flat + 1)), flat, source=1,
                                  trusted=frozenset({1}))
    assert judged == audit_applied.AppliedJudgement(stepped=True, suspend=True)
    event = audit.applied_gradient_event(step=5, stage=1, sender=3)
    jsonschema.validate([event], FLAG_EVENTS_SCHEMA)
    assert proven([event]) == {3} and blame_weights([event])[3] == math.inf


def test_without_a_trusted_replica_a_disagreement_stops_the_audits_and_names_nobody():
    flat = torch.randn(10)
    lie = audit_applied.digest(flat + 1)
    assert audit_applied.judge_applied(_reports(flat, r3=lie), flat, source=1, trusted=frozenset()) == \
        audit_applied.AppliedJudgement(stepped=True, suspend=True)
    # the source's tensor is not what it reports (both from it alone): an untrusted source lies, a trusted one
    # (which cannot) is not named; the audits stop either way
    judged = audit_applied.judge_applied(_reports(flat), flat + 1, source=1, trusted=frozenset())
    assert judged.suspend and judged.liars == (1,)
    judged = audit_applied.judge_applied(_reports(flat), flat + 1, source=1, trusted=frozenset({1}))
    assert judged.suspend and not judged.liars
    # a sole replica's update is its own word (it reports only whether it stepped): what it sends is stepped with,
    # and a lie about it leaves the copy off the weights it computes with, which its audits then fail
    assert audit_applied.judge_applied({1: tuple(audit_applied.stepped_only(flat).tolist())}, flat + 1, source=1,
                                trusted=frozenset()) == audit_applied.AppliedJudgement(stepped=True, suspend=False)
    assert not audit_applied.judge_applied({1: tuple(audit_applied.stepped_only(None).tolist())}, flat, source=1,
                                    trusted=frozenset()).stepped
    assert audit_applied.judge_applied(_reports(flat), flat, source=1, trusted=frozenset()) == \
        audit_applied.AppliedJudgement(stepped=True, suspend=False)
    nothing = {r: tuple(audit_applied.digest(None).tolist()) for r in (1, 2, 3)}
    assert audit_applied.judge_applied(nothing, torch.zeros(10), source=1, trusted=frozenset()) == \
        audit_applied.AppliedJudgement(stepped=False, suspend=False)


class _Verifier:
    def __init__(self):
        self.audits, self.flags, self.suspended = [], [], []

    def record_audit(self, sender, step, *, passed):
        self.audits.append((sender, step, passed))

    def add_flags(self, step, events):
        self.flags += [(step, e) for e in events]

    def suspend_audits(self, stage, step):
        self.suspended.append((stage, step))


def _sync(monkeypatch, *, trusted, lie_by: int):
    """The auditor (rank 0) of stage 1 on replicas 1 (the source) and 2 hears ``lie_by``'s digest of another
    gradient, then steps its copy or not (``_sync_copy`` with the messages stubbed)."""
    module = torch.nn.Linear(2, 1, bias=False)
    runtime = type("R", (), {"module": module, "parameters": lambda self: tuple(module.named_parameters())})()
    copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    flat = torch.tensor([1.0, 2.0, 1.0])   # the weight's gradient, then its presence flag
    digests = {0: torch.zeros(1 + audit_applied.DIGEST_WORDS, dtype=torch.int64), 1: audit_applied.digest(flat),
               2: audit_applied.digest(flat)}
    digests[lie_by] = audit_applied.digest(flat * 2)
    replies = iter([digests, {0: torch.zeros(3), 1: flat}])
    monkeypatch.setattr(audit_sync.control, "gather_to", lambda *a, **k: next(replies))
    st = audit_state.AuditedStage(stage=1, replicas=(1, 2), auditor=0, source=1, every=4)
    verifier = _Verifier()
    ex = SimpleNamespace(rank=0, device=torch.device("cpu"), verify=SimpleNamespace(verifier=verifier),
                         audits=audit_state.RuntimeAudits(stages={1: st}, copies={1: copy}, trusted=frozenset(trusted)))
    before = module.weight.detach().clone()
    audit_sync._sync_copy(ex, st, step=3)
    return verifier, ex.audits, not torch.equal(before, module.weight.detach())


def test_a_lying_untrusted_twin_of_a_trusted_replica_is_flagged_and_cannot_stop_the_audits(monkeypatch):
    verifier, state, stepped = _sync(monkeypatch, trusted={0, 1}, lie_by=2)
    assert verifier.audits == [(2, 3, False)] and [e["sender"] for _, e in verifier.flags] == [2]
    assert proven([e for _, e in verifier.flags]) == {2}
    assert not verifier.suspended and not state.suspended and stepped   # the copy steps with the trusted tensor


def test_without_a_trusted_replica_a_lie_stops_the_stages_audits(monkeypatch):
    verifier, state, stepped = _sync(monkeypatch, trusted={0}, lie_by=2)
    assert verifier.suspended == [(1, 3)] and state.suspended == {1: 3} and not verifier.flags and not stepped


def _final(rank: int, audits_summary) -> dict:
    return {"rank": rank, "stage": 0, "device_type": "cpu", "fwd_factor": 1.0, "bwd_factor": 1.0,
            "verification": {"flags": 0, "audits": audits_summary}, "bans": [], "attacked": []}


@pytest.mark.parametrize("forged", [{"one": "x"}, {"run_by_sender": {"one": "x"}}, {"failed_by_sender": {"1": -3}},
                                    {"run": "many"}, {"suspended": {"1": 1.5}}])
def test_a_forged_audit_summary_is_a_protocol_error_naming_its_sender(forged):
    data = json.dumps(_final(2, forged)).encode()
    with pytest.raises(ProtocolError, match="rank 2 sent a malformed run summary"):
        messages.decode(data, sender=2, what="run summary", schema=RANK_FINAL_SCHEMA)
    honest = {"run": 3, "failed": 1, "run_by_sender": {"1": 2, "2": 1}, "failed_by_sender": {"1": 1},
              "suspended": {}}
    assert messages.decode(json.dumps(_final(0, honest)).encode(), sender=0, what="run summary",
                           schema=RANK_FINAL_SCHEMA)["verification"]["audits"] == honest


def test_the_run_summary_counts_only_the_verifier_ranks_audits():
    plan = _watched_plan(4)   # rank 0 verifies; ranks 1 and 2 are the untrusted replicas
    assert {v.rank for v in plan.verifiers} == {0}
    ranks = [_final(0, {"run": 4, "failed": 0, "run_by_sender": {"1": 2, "2": 2}, "failed_by_sender": {},
                        "suspended": {"1": 3}, "signed": {"forged": 1, "voided": 2}}),
             _final(1, {"run": 9, "failed": 9, "run_by_sender": {"2": 9}, "failed_by_sender": {"2": 9},
                        "suspended": {"1": 0}, "signed": {"forged": 0, "voided": 7}}),
             _final(2, {})]
    counts = audit_counts(plan, ranks)
    assert counts == {"run": {"1": 2, "2": 2}, "failed": {}, "suspended": {"1": 3},
                      "signed": {"forged": 1, "voided": 2}}
    console = Console(width=200, record=True)
    console.print(summary_table({"model": "mlp-tiny", "num_ranks": 3, "schedule": "1f1b", "steps": 2,
                                 "predicted_step_ms": 1.0, "measured_step_ms": 1.0, "final_loss": 1.0,
                                 "verified_boundaries": [0, 1], "flags": 0, "dropped": [0], "banned": [],
                                 "ranks": ranks, "audits": json.loads(json.dumps(counts))}))
    text = console.export_text().splitlines()
    (line,) = [line for line in text if "replica audits" in line]
    assert "4 / 0: rank 1 2/0, rank 2 2/0" in line, line
    (line,) = [line for line in text if "audits stopped" in line]
    assert "stage 1 from step 3" in line, line
    (line,) = [line for line in text if "signed inputs forged" in line]
    assert "1 / 2" in line, line


def test_the_run_summary_counts_only_the_verifier_ranks_flags_and_alerts():
    plan = _watched_plan(4)   # rank 0 verifies; ranks 1 and 2 are the untrusted replicas
    ranks = [_final(0, {}), _final(1, {}), _final(2, {})]
    ranks[0]["verification"].update(flags=3, alerts=1)
    ranks[1]["verification"].update(flags=99, alerts=50)   # an untrusted rank's word on flags is not read
    assert verifier_sum(plan, ranks, "flags") == 3 and verifier_sum(plan, ranks, "alerts") == 1


@pytest.mark.parametrize("verifiers", [
    [(0, 0, BOTH), (1, 4, BOTH)],            # its input checked by another verifier
    [(0, 4, ("grad",)), (1, 4, BOTH)],       # its auditor sees no input activations
])
def test_a_stage_whose_auditor_does_not_hold_its_input_is_audited_from_the_trusted_upstream_copies(verifiers):
    plan = _three_stages(replicated=1, untrusted=(1, 2), verifiers=verifiers)
    (st,) = audit_state.audited_stages(plan, every=None, verifying=True).values()
    assert (st.stage, st.auditor, st.replicas, st.copied_from) == (1, 4, (1, 2), (0,))
    where = audit_site(plan, 1)
    assert isinstance(where, AuditWhere) and where.copied_from == (0,) and not where.grads


def test_one_untrusted_replica_is_audited_from_copies_but_not_where_its_link_tests_check_it():
    def plan(verifiers):
        out = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                        untrusted=(1,), verifiers=verifiers, verifier_host=True)
        return dataclasses.replace(out, stages=tuple(dataclasses.replace(s, audit_every=4) for s in out.stages))

    split, linked = plan([(0, 0, BOTH), (1, 3, BOTH)]), plan([(0, 3, BOTH), (1, 3, BOTH)])
    (st,) = audit_state.audited_stages(split, every=None, verifying=True).values()
    assert (st.replicas, st.auditor, st.source, st.copied_from) == ((1,), 3, 1, (0,))
    assert audit_state.audited_stages(linked, every=None, verifying=True) == {}
    assert "link tests" in audit_site(linked, 1)


def test_the_upstream_ranks_copy_exactly_the_microbatches_the_auditor_audits():
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={0: (3, 5), 1: (6, 2)}, untrusted=(2, 3), verifiers=[(0, 0, BOTH), (1, 4, BOTH)])
    st = audit_state.AuditedStage(stage=1, replicas=(2, 3), auditor=4, source=2, every=3, copied_from=(0, 1))
    schedule = audit.AuditSchedule(b"k" * 16, 3)
    for step in range(5):
        copied = [audit_inputs.copied_mbs(plan, schedule, st, u, step) for u in st.copied_from]
        audited = [mb for mb in range(8) if audit_inputs.scheduled(plan, schedule, 1, mb, step)]
        assert sorted(copied[0] + copied[1]) == audited and not set(copied[0]) & set(copied[1])
        assert all(plan.owner(0, mb) == u for u, mbs in zip(st.copied_from, copied) for mb in mbs)


def test_copied_inputs_come_back_in_their_shapes_and_dtypes():
    specs = [ValueSpec(name="h", shape=(2, 3), dtype=torch.bfloat16, carries_grad=True),
             ValueSpec(name="i", shape=(2,), dtype=torch.int64, carries_grad=False)]
    sent = [[torch.randn(2, 3).to(torch.bfloat16), torch.tensor([7, 2 ** 40])] for _ in range(2)]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for one in sent for t in one])
    back = audit_inputs.unflatten(flat, specs, 2)
    for got, want in zip(back, sent):
        assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0].float())
        assert got[1].dtype == torch.int64 and torch.equal(got[1], want[1])


@pytest.mark.parametrize("p, random", [(0.1, "dropout"), (0.0, None)])
def test_a_stage_drawing_random_numbers_is_never_audited(p, random):
    """A recompute would draw other dropout masks than the replica and fail it: such a stage is not audited."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(p), torch.nn.Linear(4, 2)).train()
    module = torch.export.export(model, (torch.randn(3, 4),), strict=False).module()
    found = random_op(module)
    assert (found is not None and "dropout" in found) if random else found is None, found
    assert random_op(torch.nn.Linear(2, 2)) is None   # no graph: nothing known random
