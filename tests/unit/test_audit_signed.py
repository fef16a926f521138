"""Audits from signed inputs (issue 37): a stage fed by an untrusted stage is audited from the inputs its own
replicas forward, signed by the upstream ranks (``audit_price.audit_rule``). The rule's answer and the refusals
that stay, the price of signing (``cost_models.audit``), the simulated step (by hand) and the planner's price
against it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_models.audit import (
    HASH_BYTES_PER_S,
    audit_ms,
    check_signature_ms,
    copied_input_bytes,
    sign_ms,
)
from cost_models.cluster import Link
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel
from planner.simulate import simulate
from planner.simulate_audits import audit_site as plan_audit_site
from planner.solver.audit_price import AuditWhere, audit_rule, audit_site, signing_ms
from planner.solver.audits import audit_notes
from planner.solver.objective import Placement, price_program
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem
from planner.solver.solution import VerifierPlacement
from tests.unit.plan_fixtures import (
    SLOW_DEVICE,
    TEST_DEVICE,
    block,
    chain,
    cluster,
    compile_simple,
    config,
    solution,
)

torch.set_num_threads(1)

TRUSTED = {"t2", "v"}


def _rule(replicas=("u1", "u2"), upstream=("u0b", "u0"), checks=((1, "act"),), codecs=("none", "none"),
          auditor="v", stage=1, num_stages=3, random_ops=()):
    return audit_rule(stage=stage, num_stages=num_stages, replicas=replicas, upstream=upstream, downstream=("t2",),
                      trusted=TRUSTED, auditor=auditor, auditor_checks=checks, codecs=codecs,
                      random_ops=random_ops)


def test_a_stage_fed_by_an_untrusted_stage_is_audited_from_its_replicas_signed_inputs():
    signed = AuditWhere(auditor="v", source="u1", grads=False, copied_from=("u1", "u2"), signed_by=("u0", "u0b"))
    assert _rule() == signed
    # held or not, gradients checked or not: the replicas forward the inputs, outputs only
    assert _rule(checks=((0, "act"), (0, "grad"), (1, "act"), (1, "grad"))) == signed
    # one untrusted upstream device among trusted ones: all of them sign
    assert _rule(upstream=("t0", "u0")).signed_by == ("t0", "u0")
    # a sole replica, even where its verifier holds both its boundaries (no link test can frame it)
    assert _rule(replicas=("u1",), checks=((0, "act"), (1, "act"))) == \
        AuditWhere(auditor="v", source="u1", grads=False, copied_from=("u1",), signed_by=("u0", "u0b"))
    # a trusted replica is the source; by ranks too
    assert _rule(replicas=("u2", "t2")).source == "t2"
    where = audit_rule(stage=2, num_stages=4, replicas=[3, 2], upstream=[1], downstream=[4], trusted={4, 5},
                       auditor=5, auditor_checks={(2, "act")}, codecs=("none", "none"))
    assert where == AuditWhere(auditor=5, source=3, grads=False, copied_from=(2, 3), signed_by=(1,))


def test_the_other_refusals_hold_for_a_stage_fed_by_an_untrusted_stage():
    assert "first stage" in _rule(stage=0, upstream=())
    assert "last stage" in _rule(stage=2)
    assert "no verifier checks its output activations" in _rule(checks=((1, "grad"),))
    assert "no verifier checks its output activations" in _rule(auditor=None)
    assert "is one of its replicas" in _rule(auditor="u1")
    assert "input boundary travels int8-encoded" in _rule(codecs=("int8", "none"))
    assert "output boundary travels fp8-encoded" in _rule(replicas=("u1",), codecs=("none", "fp8"))
    assert "draws random numbers (dropout)" in _rule(random_ops=("dropout",))
    assert "runs on trusted devices only" in _rule(replicas=("t2",))
    # a trusted upstream stage: copies from it, and a linked sole replica is still left to its link tests
    assert _rule(upstream=("v",)).signed_by == () and _rule(upstream=("v",)).copied_from == ("v",)
    assert "its link tests check it" in _rule(replicas=("u1",), upstream=("v",), checks=((0, "act"), (1, "act")))


def test_signing_is_priced_as_measured_and_the_copies_wait_for_the_request_and_the_gradient():
    assert HASH_BYTES_PER_S == 2.0e9   # 1.57 MB hashed in 0.76 ms (2-core VM)
    assert sign_ms(1.57e6) == pytest.approx(0.785 + 0.02) and check_signature_ms(1.57e6) == pytest.approx(0.845)
    fast = Link(bandwidth_gbps=8.0, latency_ms=1.0)
    kw = {"every": 4, "microbatches": 8, "params": 10**6, "param_tensors": 4, "forward_ms": 10.0,
          "output_bytes": 1e6, "input_bytes": 1e6, "source_link": fast, "digest_link": fast,
          "verifier_mem_bw_bytes_per_s": 1e10, "optim_ms": 3.0}
    cost = audit_ms(**kw, copy_links=((fast, 4), (fast, 4)), signed=True)
    # each replica asked (a latency) once the copy before is in: the first request apart, the second in copy_ms
    assert cost.signed and cost.copied and cost.request_ms == 1.0
    assert cost.copy_ms == pytest.approx(2 * (1.0 + 4 / 4 * 1e6 / 1e9 * 1e3) + 1.0)
    # the replicas send once done and asked (a latency after the auditor is done), behind the source's gradient
    assert cost.inputs_in_ms(auditor_free_ms=100.0, upstream_done_ms=90.0, gradient_sent_ms=0.0) == \
        pytest.approx(100.0 + cost.gradient_ms + cost.copy_ms)
    assert cost.inputs_in_ms(auditor_free_ms=100.0, upstream_done_ms=150.0, gradient_sent_ms=0.0) == \
        pytest.approx(150.0 + cost.copy_ms)
    slow_gradient = dataclasses.replace(cost, gradient_ms=0.5)
    assert slow_gradient.inputs_in_ms(auditor_free_ms=100.0, upstream_done_ms=90.0, gradient_sent_ms=0.0) == \
        pytest.approx(101.0 + cost.copy_ms)
    with pytest.raises(InvalidInputError):
        audit_ms(**kw, signed=True)   # signed inputs come from the replicas' copies
    with pytest.raises(InvalidInputError):
        audit_ms(**kw, copy_links=((fast, 8),), signed=True, backward_ms=5.0)


def _shape(every: int, replicas: tuple[str, ...], verifiers: tuple[VerifierPlacement, ...]):
    """An untrusted stage 0 (worker-e) feeding stage 1 on ``replicas`` (untrusted), a trusted last stage, a CPU
    verifier host watching stage 1's outputs, 4 microbatches, 1 Gb/s, 0.5 ms."""
    ch = chain([block(i, fwd_flops=(i + 1) * 10**9, params=(i + 1) * 10**4) for i in range(5)], name="signed")
    cl = cluster([("worker-e", TEST_DEVICE, 1), ("worker-b", TEST_DEVICE, 1), ("worker-c", SLOW_DEVICE, 1),
                  ("trusted-d", TEST_DEVICE, 1)], bandwidth_gbps=1.0, latency_ms=0.5, verifier_host=True,
                 trusted=("trusted-d",))
    splits = [(4,), (2, 2) if len(replicas) == 2 else (4,), (4,)]
    sol = solution([(0, 0), (1, 2), (3, 4)], [("worker-e/0",), replicas, ("trusted-d/0",)], 4, splits=splits,
                   verifiers=verifiers)
    stages = tuple(dataclasses.replace(st, audit_every=every if st.index == 1 else 0) for st in sol.stages)
    return ch, cl, dataclasses.replace(sol, stages=stages)


OUTPUTS = (VerifierPlacement(boundary=1, device="verifier/0", directions=("act",)),)
HELD = (VerifierPlacement(boundary=0, device="verifier/0", directions=("act", "grad")),
        VerifierPlacement(boundary=1, device="verifier/0", directions=("act", "grad")))


@pytest.mark.parametrize("replicas, verifiers", [(("worker-b/0", "worker-c/0"), OUTPUTS),
                                                 (("worker-b/0", "worker-c/0"), HELD),
                                                 (("worker-c/0",), HELD)])
def test_a_stage_fed_by_an_untrusted_stage_is_simulated_and_priced_as_the_runtime_audits_it(replicas, verifiers):
    """By hand: rank 0 (stage 0) signs each activation it sends (its forwards last ``sign_ms`` longer), the
    replicas check each input's signature (``check_signature_ms``); at the step's end the auditor asks them for
    the audited inputs (64 KiB each, float32, one in 4), which each sends once done and asked, the source behind
    its applied gradient; the planner prices the audited step within 5% of that."""
    ch, cl, plain_sol = _shape(0, replicas, verifiers)
    audited_sol = _shape(4, replicas, verifiers)[2]
    problem = build_problem(ch, cl, config(4), VerificationPolicy())
    priced = [price_program(problem, Placement(stages=sol.stages, verifiers=sol.verifiers, num_microbatches=4))
              for sol in (plain_sol, audited_sol)]
    # compiled with the in-flight limits they are priced at (as the planner's plans are)
    plain, audited = (compile_simple(ch, cl, dataclasses.replace(sol, stages=tuple(
        dataclasses.replace(st, in_flight=n) for st, n in zip(sol.stages, cost.in_flight))))
        for sol, cost in zip((plain_sol, audited_sol), priced))
    auditor, ranks = audited.num_ranks - 1, audited.stage_ranks(1)
    where = plan_audit_site(audited, 1)
    assert where == AuditWhere(auditor=auditor, source=ranks[0], grads=False, copied_from=tuple(ranks),
                               signed_by=(0,))
    payload = CostModel.for_plan(audited).wire_bytes[0]
    assert payload == 2**16
    got, base = simulate(audited), simulate(plain)

    def forwards(sim, r):
        return {e.mb: e.end_ms - e.start_ms for e in sim.events if e.rank == r and e.kind == "F"}

    for r, extra in [(0, sign_ms(payload)), *((r, check_signature_ms(payload)) for r in ranks)]:
        with_signing, without = forwards(got, r), forwards(base, r)
        assert with_signing.keys() == without.keys() and with_signing
        assert all(with_signing[mb] == pytest.approx(without[mb] + extra, rel=1e-9) for mb in without)
    assert forwards(got, 3) == pytest.approx(forwards(base, 3))   # the trusted last stage signs nothing
    # the copies: each replica's audited inputs, once it is done and the auditor's request (0.5 ms), sent once
    # the copy before is in, reached it
    done = {r: max(e.end_ms for e in got.events if e.rank == r and e.kind != "send" and "audit" not in e.label)
            for r in range(audited.num_ranks)}
    stepping = min(e.start_ms for e in got.events if e.rank == ranks[0] and e.kind == "optim")
    gradient = 0.5 + 1e3 * 4 * (50_000 + 2) / 1.25e8
    t = done[auditor]
    for r in ranks:
        begin = max(t + 0.5, done[r])
        if r == ranks[0]:
            begin = max(begin, max(stepping, done[auditor]) + gradient)
        t = begin + 0.5 + 1e3 * len(audited.ranks[r].microbatches) / 4 * copied_input_bytes(2**16, 4) / 1.25e8
        (sent,) = [e for e in got.events if e.label == "stage 1 audit: input copy" and e.rank == r]
        assert (sent.kind, sent.peer) == ("send", auditor)
        assert (sent.start_ms, sent.end_ms) == (pytest.approx(begin, rel=1e-9), pytest.approx(t, rel=1e-9))
    (box,) = [e for e in got.events if e.label == "stage 1 audit: input copies"]
    assert (box.rank, box.start_ms, box.end_ms) == (auditor, done[auditor], pytest.approx(t, rel=1e-9))
    site = audit_site(problem, audited_sol.stages, audited_sol.verifiers, 1)
    assert site is not None and site.signed_by == ("worker-e/0",) and site.copied_from == tuple(sorted(replicas))
    assert signing_ms(problem, audited_sol.stages, audited_sol.verifiers) == {
        (0, "worker-e/0"): pytest.approx(sign_ms(payload)),
        **{(1, d): pytest.approx(check_signature_ms(payload)) for d in replicas}}
    assert signing_ms(problem, plain_sol.stages, plain_sol.verifiers) == {}   # no audit, no signing
    added, priced_added = got.step_ms - base.step_ms, priced[1].step_ms - priced[0].step_ms
    # what the audit and the signing add: the copies and digests, and the last step's recompute on the copy's
    # stepper, beside the verifier host's checks (``audit_stepper.Stepper``), a few ms
    assert added > 0 and priced_added == pytest.approx(added, rel=0.05)
    assert priced[1].step_ms == pytest.approx(got.step_ms, rel=0.05)


def test_the_notes_say_the_audit_is_from_signed_inputs():
    ch, cl, sol = _shape(4, ("worker-b/0", "worker-c/0"), OUTPUTS)
    problem = build_problem(ch, cl, config(4), VerificationPolicy())
    notes = audit_notes(problem, Placement(stages=sol.stages, verifiers=sol.verifiers, num_microbatches=4))
    (note,) = [n for n in notes if n.startswith("stage 1:")]
    assert "audited by verifier/0" in note and "from signed inputs" in note, note
    assert "signed by stage 0 (worker-e/0)" in note and "worker-b/0, worker-c/0" in note, note


def test_slow_signing_is_priced_on_the_senders_and_the_replicas_as_simulated(monkeypatch):
    """Signing 10x dearer than measured (a slow sender's CPU): the step grows by a signature and a check on its
    path (a forward of stage 0's, then one of a replica's), priced as simulated."""
    ch, cl, audited_sol = _shape(4, ("worker-b/0", "worker-c/0"), OUTPUTS)

    def step_ms() -> tuple[float, float]:  # a problem of its own: prices are memoised per problem
        problem = build_problem(ch, cl, config(4), VerificationPolicy())
        placement = Placement(stages=audited_sol.stages, verifiers=audited_sol.verifiers, num_microbatches=4)
        return price_program(problem, placement).step_ms, simulate(compile_simple(ch, cl, audited_sol)).step_ms

    measured = step_ms()
    # one definition of who pays what (``cost_models.audit.signing_work``), read by the price and the simulator
    monkeypatch.setattr("cost_models.audit.sign_ms", lambda nbytes: 10 * sign_ms(nbytes))
    monkeypatch.setattr("cost_models.audit.check_signature_ms", lambda nbytes: 10 * check_signature_ms(nbytes))
    slow = step_ms()
    grown = 9 * (sign_ms(2**16) + check_signature_ms(2**16))
    assert slow[1] - measured[1] == pytest.approx(grown, rel=0.05)
    assert slow[0] - measured[0] == pytest.approx(slow[1] - measured[1], rel=0.05)
    assert slow[0] == pytest.approx(slow[1], rel=0.005)
