"""The pure parts of the runtime's audits (``planner.runtime.rank.audits``): the applied-gradient digest, the
comparison of a sent tensor with its recompute, and the copy's optimizer step."""
from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch

from planner.runtime.options import RunOptions, add_run_arguments
from planner.runtime.rank import audits
from planner.simulate import audit_site, audited_stages
from planner.solver.audit_price import AuditWhere
from tests.dist.plans import make_plan


def test_the_digest_tells_equal_gradients_from_any_changed_value():
    flat = torch.randn(100)
    assert torch.equal(audits.digest(flat), audits.digest(flat.clone()))
    bumped = flat.clone()
    bumped[37] = torch.nextafter(bumped[37], torch.tensor(math.inf))
    assert not torch.equal(audits.digest(flat), audits.digest(bumped))
    assert audits.digest(None).tolist() == [0] * (1 + audits.DIGEST_WORDS)
    assert audits.digest(flat)[0] == 1 and audits.digest(flat).dtype == torch.int64


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
    copy = audits.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0))
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
    (st,) = audits.audited_stages(_watched_plan(4), every=None, verifying=True, resumed=False).values()
    # rank 0 verifies stage 1's outputs: its auditor; no replica trusted: the lowest sends its gradient whole
    assert (st.stage, st.replicas, st.auditor, st.source, st.every) == (1, (1, 2), 0, 1, 4)
    assert audits.audited_stages(_watched_plan(8), every=None, verifying=True, resumed=False)[1].every == 8


def test_without_audit_every_a_run_does_not_audit_a_stage_the_plan_does_not():
    # 0: the planner chose no audits there (too dear), or the plan predates them
    assert audits.audited_stages(_watched_plan(0), every=None, verifying=True, resumed=False) == {}


def test_an_explicit_audit_every_overrides_the_plans_choice_on_every_watched_stage():
    assert audits.audited_stages(_watched_plan(0), every=2, verifying=True, resumed=False)[1].every == 2
    assert audits.audited_stages(_watched_plan(8), every=2, verifying=True, resumed=False)[1].every == 2
    assert audits.audited_stages(_watched_plan(8), every=0, verifying=True, resumed=False) == {}
    assert audits.audited_stages(_watched_plan(8), every=None, verifying=False, resumed=False) == {}
    assert audits.audited_stages(_watched_plan(8), every=None, verifying=True, resumed=True) == {}


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
    ("fed by an untrusted stage", 1, (0, 1, 2), [(0, 4, BOTH), (1, 4, BOTH)]),
    ("its input checked by another verifier", 1, (1, 2), [(0, 0, BOTH), (1, 4, BOTH)]),
    ("its auditor sees no input activations", 1, (1, 2), [(0, 4, ("grad",)), (1, 4, BOTH)]),
])
def test_the_runtime_never_audits_a_stage_the_planners_rule_rules_out(why, replicated, untrusted, verifiers):
    plan = _three_stages(replicated=replicated, untrusted=untrusted, verifiers=verifiers)
    assert audits.audited_stages(plan, every=4, verifying=True, resumed=False) == {}, why
    assert audited_stages(plan) == {}, why   # the simulator neither
    assert all(isinstance(audit_site(plan, k), str) for k in range(plan.num_stages)), why


def test_the_runtime_audits_where_the_simulator_does_and_as_the_planners_rule_says():
    plan = _three_stages(replicated=1, untrusted=(1, 2), verifiers=[(0, 4, BOTH), (1, 4, BOTH)])
    (st,) = audits.audited_stages(plan, every=None, verifying=True, resumed=False).values()
    where = audit_site(plan, 1)
    assert isinstance(where, AuditWhere) and (where.auditor, where.source, where.grads) == (4, 1, True)
    assert (st.stage, st.auditor, st.source, st.every) == (1, 4, 1, 4)
    assert audited_stages(plan) == {1: (4, 1, True)}


@pytest.mark.parametrize("stage, codec", [(0, "int8"), (1, "fp8"), (1, "int4")])
def test_the_runtime_does_not_audit_a_stage_whose_boundary_is_compressed(stage, codec):
    plan = _three_stages(replicated=1, untrusted=(1, 2), verifiers=[(0, 4, BOTH), (1, 4, BOTH)])
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, out_codec=codec) if s.index == stage else s
                                                  for s in plan.stages))
    assert audits.audited_stages(plan, every=4, verifying=True, resumed=False) == {}
    assert audited_stages(plan) == {}
    assert "encoded" in audit_site(plan, 1)
