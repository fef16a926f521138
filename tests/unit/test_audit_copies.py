"""Copied-input audits (issue 37, item 3): where a stage's auditor does not verify its input boundary but the
stage before it is trusted, that stage's ranks copy it the audited microbatches' inputs at the step's end. The
rule (``audit_price.audit_rule``), the copy's price (``cost_models.audit``), the simulated step (by hand) and the
planner's price of random copied and held audits against their simulation."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cost_models import compute
from cost_models.audit import audit_ms, copied_input_bytes
from cost_models.cluster import Link
from cost_models.optim import optim_ms
from planner.errors import InvalidInputError
from planner.schedules import max_in_flight
from planner.simulate import simulate
from planner.simulate_audits import audit_site as plan_audit_site
from planner.solver.audit_price import (
    AuditWhere,
    audit_rule,
    audit_site,
)
from planner.solver.audit_stepper import Stepper, StepperPart
from planner.solver.audits import EVERY_CHOICES, with_audits
from planner.solver.objective import Placement, price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem
from planner.solver.solution import VerifierPlacement
from planner.solver.verifiers import assign_verifiers
from tests.unit import program_fixtures as pf
from tests.unit.plan_fixtures import (
    CPU_DEVICE,
    SLOW_DEVICE,
    TEST_DEVICE,
    block,
    chain,
    cluster,
    compile_simple,
    config,
    solution,
)
from tests.unit.stepper_fixtures import assert_checks_share_the_device

torch.set_num_threads(1)

# Stage 1 (untrusted) between trusted stages: its input's gradient checked on trusted-d, its outputs on the
# verifier host, which therefore holds no input and is copied them from trusted-a (stage 0).
SPLIT = (VerifierPlacement(boundary=0, device="trusted-d/0", directions=("grad",)),
         VerifierPlacement(boundary=1, device="verifier/0", directions=("act",)))


def _rule(replicas=("u1", "u2"), upstream=("t0",), checks=((1, "act"),), codecs=("none", "none"), auditor="v"):
    return audit_rule(stage=1, num_stages=3, replicas=replicas, upstream=upstream, downstream=("t2",),
                      trusted={"t0", "t0b", "t2", "v"}, auditor=auditor, auditor_checks=checks, codecs=codecs)


def test_the_rule_audits_from_copies_where_the_auditor_holds_no_input_and_the_stage_before_is_trusted():
    where = _rule(upstream=("t0b", "t0"), checks=((1, "act"), (1, "grad"), (0, "grad")))
    # the stage after trusted: it copies the gradients it sent too (``grads_from``)
    assert where == AuditWhere(auditor="v", source="u1", grads=False, copied_from=("t0", "t0b"), grads_from=("t2",))
    # one untrusted replica: copied mode audits it too
    assert _rule(replicas=("u1",)) == AuditWhere(auditor="v", source="u1", grads=False, copied_from=("t0",),
                                                 grads_from=("t2",))
    # held: the auditor verifies the input boundary (no copies), gradients too where it checks both
    held = _rule(checks=((0, "act"), (0, "grad"), (1, "act"), (1, "grad")))
    assert held == AuditWhere(auditor="v", source="u1", grads=True, copied_from=())


def test_the_rule_refuses_compressed_boundaries_and_a_linked_single_replica_and_signs_an_untrusted_stages_inputs():
    assert "its link tests check it" in _rule(replicas=("u1",), checks=((0, "act"), (1, "act")))
    # an untrusted stage before: the replicas forward its signed inputs (``test_audit_signed``)
    assert _rule(upstream=("t0", "u9")) == AuditWhere(auditor="v", source="u1", grads=False, copied_from=("u1", "u2"),
                                                      signed_by=("t0", "u9"))
    assert "input boundary travels int8-encoded" in _rule(codecs=("int8", "none"))
    assert "output boundary travels fp8-encoded" in _rule(replicas=("u1",), codecs=("none", "fp8"))
    assert "no verifier checks its output activations" in _rule(checks=((1, "grad"),))
    assert "runs on trusted devices only" in _rule(replicas=("t0",))


def test_the_copies_are_float32_received_rank_after_rank_before_the_recompute():
    fast, slow = Link(bandwidth_gbps=8.0, latency_ms=1.0), Link(bandwidth_gbps=0.8, latency_ms=2.0)
    kw = {"every": 4, "microbatches": 8, "params": 10**6, "param_tensors": 4, "forward_ms": 10.0,
          "output_bytes": 1e6, "input_bytes": 1e6, "source_link": fast, "digest_link": fast,
          "verifier_mem_bw_bytes_per_s": 1e10, "optim_ms": 3.0}
    # a bf16 input of 1 MB travels as 2 MB of float32; the fast rank sends 6 of the 8 microbatches, the slow 2
    cost = audit_ms(**kw, copy_links=((fast, 6), (slow, 2), (None, 8)), input_elem_bytes=2)
    assert copied_input_bytes(1e6, 2) == 2e6
    assert cost.copied and not cost.during_step
    assert cost.copy_ms == pytest.approx((1.0 + 6 / 4 * 2e6 / 1e9 * 1e3) + (2.0 + 2 / 4 * 2e6 / 1e8 * 1e3))
    assert cost.total_ms == pytest.approx(cost.copy_ms + cost.recompute_ms + cost.gradient_ms + cost.digest_ms + 3.0)
    # the copies travel once the upstream stage is done and the auditor has posted its receives; the gradient,
    # posted for first, arrives meanwhile; the recompute (deferred: on the copy's stepper during the next step) and
    # the copy's step (3 ms) run off the step's end
    assert cost.deferred and not audit_ms(**kw, backward_ms=5.0).deferred   # gradients: among the checks
    assert cost.end_ms(auditor_free_ms=100.0, replicas_done_ms=0.0, upstream_done_ms=110.0) == \
        pytest.approx(110.0 + cost.copy_ms + cost.digest_ms)
    assert cost.end_ms(auditor_free_ms=200.0, replicas_done_ms=0.0, upstream_done_ms=110.0) == \
        pytest.approx(200.0 + cost.copy_ms + cost.digest_ms)
    assert cost.end_ms(auditor_free_ms=100.0, replicas_done_ms=500.0, upstream_done_ms=110.0) == \
        pytest.approx(500.0 + cost.gradient_ms)
    held = audit_ms(**kw)
    assert held.copy_ms == 0.0 and not held.copied
    assert held.end_ms(auditor_free_ms=100.0, replicas_done_ms=0.0, upstream_done_ms=1e6) == \
        pytest.approx(100.0 + held.gradient_ms)   # no recompute to hide the gradient's transfer behind
    # the step's end waits for the stepper's queue: the last step's recomputes, then the copy's step (3 ms)
    assert held.stepper_done_ms == pytest.approx(held.recompute_ms + 3.0)
    assert held.end_ms(auditor_free_ms=1.0, replicas_done_ms=0.0) == pytest.approx(held.recompute_ms + 3.0)
    with pytest.raises(InvalidInputError):   # copied inputs are audited for outputs only
        audit_ms(**kw, backward_ms=5.0, copy_links=((fast, 8),))


def _small(every: int, replicas: tuple[str, ...] = ("worker-b/0", "worker-c/0")):
    """Trusted ends, stage 1 on ``replicas`` (untrusted), a CPU verifier host, 4 microbatches, 1 Gb/s."""
    ch = chain([block(i, fwd_flops=(i + 1) * 10**9, params=(i + 1) * 10**4) for i in range(5)], name="copies")
    cl = cluster([("trusted-a", TEST_DEVICE, 1), ("worker-b", TEST_DEVICE, 1), ("worker-c", SLOW_DEVICE, 1),
                  ("trusted-d", TEST_DEVICE, 1)], bandwidth_gbps=1.0, latency_ms=0.5, verifier_host=True,
                 trusted=("trusted-a", "trusted-d"))
    splits = [(4,), (2, 2) if len(replicas) == 2 else (4,), (4,)]
    sol = solution([(0, 0), (1, 2), (3, 4)], [("trusted-a/0",), replicas, ("trusted-d/0",)], 4, splits=splits,
                   verifiers=SPLIT)
    stages = tuple(dataclasses.replace(st, audit_every=every if st.index == 1 else 0) for st in sol.stages)
    return ch, cl, dataclasses.replace(sol, stages=stages)


def _limited(ch, cl, sol, limits: str):
    """(``sol`` carrying in-flight limits, its price): ``priced``, those its price assumes (as the planner's plans
    carry them), or ``least``, the schedule's least (what compiling it without limits gives)."""
    problem = build_problem(ch, cl, config(sol.num_microbatches), VerificationPolicy())
    if limits == "priced":
        in_flight = price_program(problem, Placement(stages=sol.stages, verifiers=SPLIT,
                                                     num_microbatches=sol.num_microbatches)).in_flight
    else:
        in_flight = tuple(tuple(max_in_flight(sol.schedule, st.index, len(sol.stages), n) for n in st.microbatches)
                          for st in sol.stages)
    sol = dataclasses.replace(sol, stages=tuple(dataclasses.replace(st, in_flight=n)
                                                for st, n in zip(sol.stages, in_flight)))
    placement = Placement(stages=sol.stages, verifiers=SPLIT, num_microbatches=sol.num_microbatches)
    return sol, price_program(problem, placement).step_ms


@pytest.mark.parametrize("limits", ["priced", "least"])
@pytest.mark.parametrize("replicas", [("worker-b/0", "worker-c/0"), ("worker-c/0",)])
def test_the_simulated_auditor_waits_for_the_copy_recomputes_then_hears_the_gradient(replicas, limits):
    """By hand: trusted-a (rank 0) sends the verifier host its one audited input and the input gradient the
    replica sent back (64 KiB each, float32, and a 4-byte taint flag) over 1 Gb/s once its program is done, then
    trusted-d (the stage after, trusted) the gradient it sent (64 KiB, and its taint flag); the host hears the digests and the
    gradient (sent as the source's optimizer step starts, received from when the host's program is done); it
    recomputes blocks 1-2 forward and the input gradient on the copies during the next step (the weights' gradient too
    for a contribution audit), then its copy steps, on its
    stepper, beside its checks (the last step's from this step's start). The price adds what the simulation adds
    where each program carries the in-flight limits it is priced with: the sole slow replica's price raises its
    limit from the schedule's least (2) to 4, so a fixture compiled with the least (no limits carried) ran another
    program (4.6 ms priced, 6.1 simulated; 6.1 and 6.1 priced with the least, 4.6 and 4.6 run with the raised)."""
    ch, cl, _ = _small(0, replicas)
    (plain_sol, plain_ms), (audited_sol, audited_ms) = (_limited(ch, cl, _small(every, replicas)[2], limits)
                                                        for every in (0, 4))
    plain, audited = compile_simple(ch, cl, plain_sol), compile_simple(ch, cl, audited_sol)
    auditor, ranks = plain.num_ranks - 1, plain.stage_ranks(1)
    where = plan_audit_site(audited, 1)
    downstream = auditor - 1
    assert where == AuditWhere(auditor=auditor, source=ranks[0], grads=False, copied_from=(0,),
                               grads_from=(downstream,))
    base, got = simulate(plain), simulate(audited)
    spec = cl.device("verifier/0").spec
    cfg = config(4)
    copy, copy_down = 0.5 + 1e3 * (2 * 2**16 + 4) / 1.25e8, 0.5 + 1e3 * (2**16 + 4) / 1.25e8
    # the input gradient's half of the backward; two replicas of two microbatches: each drawn whole 1 in 16 a step,
    # its weights' half then too (a contribution audit), over the step's one audited microbatch
    share = 0.5 + 0.5 * (2 * 2 / 16) if len(replicas) == 2 else 0.5
    recompute = compute.range_fwd_ms(ch, 1, 2, spec) + share * compute.range_bwd_ms(ch, 1, 2, spec) \
        + 1e3 * 3 * 2 * 2**16 / CPU_DEVICE["mem_bw_bytes_per_s"]
    gradient = 0.5 + 1e3 * 4 * (50_000 + 2) / 1.25e8
    digest = 0.5 + 1e3 * 40 / 1.25e8
    # the last step's recompute and the copy's step on the auditor's stepper from the step's start, sharing the
    # host with its checks (``audit_stepper.Stepper``): each check lasts its own time plus what the stepper does
    stepper = Stepper(parts=(StepperPart(stage=1, recompute=True, ms=recompute),
                             StepperPart(stage=1, recompute=False, ms=optim_ms(50_000, cfg, spec, param_tensors=2))))
    assert_checks_share_the_device(base, got, auditor, stepper)
    end_of = {r: max(e.end_ms for e in got.events if e.rank == r and e.kind != "send" and "audit" not in e.label)
              for r in range(plain.num_ranks)}
    inputs_in = max(end_of[auditor], end_of[0]) + copy
    start = max(inputs_in, end_of[downstream]) + copy_down
    assert inputs_in > end_of[auditor]   # the copy, not the auditor's own checks, holds the recompute back
    stepping = min(e.start_ms for e in got.events if e.rank == ranks[0] and e.kind == "optim")
    heard = max(max(start, max(end_of[r] for r in ranks)) + digest, max(stepping, end_of[auditor]) + gradient,
                stepper.done_ms())
    expected = max(max(end_of.values()), heard)
    assert expected > base.step_ms
    assert got.step_ms == pytest.approx(expected, rel=1e-9)
    (box,) = [e for e in got.events if e.label == "stage 1 audit: input copies"]
    assert (box.rank, box.kind, box.start_ms, box.end_ms) == (auditor, "control", end_of[auditor], start)
    (sent,) = [e for e in got.events if e.label == "stage 1 audit: input copy"]
    assert (sent.rank, sent.kind, sent.peer, sent.end_ms) == (0, "send", auditor, inputs_in)
    (sent,) = [e for e in got.events if e.label == "stage 1 audit: gradient copy"]
    assert (sent.rank, sent.kind, sent.peer, sent.end_ms) == (downstream, "send", auditor, start)
    assert plain_ms == pytest.approx(base.step_ms, rel=0.05) and audited_ms == pytest.approx(expected, rel=0.05)
    assert audited_ms - plain_ms == pytest.approx(expected - base.step_ms, rel=0.05)   # what the audit adds


def _random_case(seed: int):
    """(priced program, compiled plan, copied stages, signed stages) of a random pool (``program_fixtures.untrusted_pool``):
    3-5 stages, trusted ends, untrusted middle stages of 1-3 replicas (one of them trusted where devices allow),
    the solver's verifiers (link tests or not) with some moved to another trusted device, every auditable stage
    audited at a random share; None where the draw has no audit or breaks a constraint."""
    rng = np.random.default_rng(seed)
    cl, ch, cfg, policy, problem = pf.untrusted_problem(rng, (8, 16))
    L, M = problem.num_blocks, problem.num_microbatches
    trusted = [d.id for d in cl.hosts[0].devices]
    untrusted = [str(d) for d in rng.permutation([d.id for h in cl.hosts[1:] for d in h.devices])]
    S = int(rng.integers(3, 6))
    groups, spare = [], trusted[2:]
    for k in range(1, S - 1):
        if k > 1 and spare and rng.random() < 0.3:
            groups.append([spare.pop()])
        else:
            n = min(int(rng.integers(1, 4)), len(untrusted))
            groups.append(untrusted[:n])
            untrusted = untrusted[n:]
    groups = [trusted[:1], *groups, trusted[1:2]]
    if any(not g for g in groups):
        return None
    cuts = sorted(rng.choice(np.arange(1, L), size=S - 1, replace=False).tolist())
    stages = tuple(pf.stages_of(cuts, [len(g) for g in groups], [d for g in groups for d in g], L, M))
    verifiers = assign_verifiers(problem, stages, M, link=int(rng.choice([1, 3])))
    if verifiers is None:
        return None
    verifiers = tuple(dataclasses.replace(v, device=str(rng.choice(trusted))) if rng.random() < 0.4 else v
                      for v in verifiers)
    sites = {k: s for k in range(S) if (s := audit_site(problem, stages, verifiers, k)) is not None}
    placement = with_audits(Placement(stages=stages, verifiers=verifiers, num_microbatches=M),
                            {k: int(rng.choice(EVERY_CHOICES)) for k in sites})
    if not sites or violations(problem, placement):
        return None
    audited, plain = (pf._compiled(problem, p, ch, cl, cfg, policy) for p in (placement, with_audits(placement, {})))
    return audited, plain, sorted(k for k, s in sites.items() if s.copied_from and not s.signed_by), \
        sorted(k for k, s in sites.items() if s.signed_by)


def test_random_copied_signed_and_held_audits_are_priced_as_they_run():
    """Random shapes (replicas 1-3, stages 3-5, random verifier placements): the planner's price of the audited
    plan within 5% of its simulation on at least 90% of the draws and never more than 5% under it; what the
    audits add to the step, never priced more than 1% of the step under what they add to the simulated one (the
    rest of the gap is the unaudited plan's). Copied from a trusted stage, or from signed inputs where the stage
    before is untrusted (the replicas forward them)."""
    off, copied, signed = [], 0, 0
    for seed in range(40):
        got = _random_case(seed)
        if got is None:
            continue
        (priced, plan), (priced_plain, plain), copied_stages, signed_stages = got
        for k in copied_stages:
            where = plan_audit_site(plan, k)
            assert isinstance(where, AuditWhere) and where.copied_from == tuple(sorted(plan.stage_ranks(k - 1)))
        for k in signed_stages:
            where = plan_audit_site(plan, k)
            assert isinstance(where, AuditWhere) and not where.grads
            assert where.copied_from == tuple(sorted(plan.stage_ranks(k)))
            assert where.signed_by == tuple(sorted(plan.stage_ranks(k - 1)))
        copied += bool(copied_stages)
        signed += bool(signed_stages)
        simulated, simulated_plain = simulate(plan).step_ms, simulate(plain).step_ms
        off.append((priced.step_ms - simulated) / simulated)
        added, priced_added = simulated - simulated_plain, priced.step_ms - priced_plain.step_ms
        assert priced_added >= added - 0.01 * simulated, (seed, priced_added, added)
    off = np.array(off)
    assert len(off) >= 25 and copied >= 15 and signed >= 8, (len(off), copied, signed)
    assert np.mean(np.abs(off) <= 0.05) >= 0.9 and off.min() >= -0.05, sorted(off)
