"""Audits of watched replicated stages in the plan (issue 37, deliverable 3): the plan's field, its price as the
runtime incurs it (``cost_models.audit``), the planner's choice (``planner.solver.audits``) and one cost."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from cost_models import compute
from cost_models.audit import audit_ms, copy_ms
from cost_models.cluster import Link
from cost_models.cluster_file import parse_cluster
from cost_models.optim import optim_ms
from planner.errors import InvalidInputError
from planner.plan import Plan
from planner.simulate import simulate
from planner.simulate_audits import audit_site as plan_audit_site
from planner.solver.audit_price import (
    INPUT_GRAD_SHARE,
    AuditWhere,
    audit_cost,
    audit_site,
    audit_where,
    audited_backward_ms,
    copied_message_bytes,
    stage_input_grad_share,
)
from planner.solver.audit_stepper import Stepper, StepperPart
from planner.solver.audits import (
    EVERY_CHOICES,
    audit_notes,
    choose_audits,
    copy_bytes,
    with_audits,
)
from planner.solver.objective import (
    Placement,
    price_program,
    program_memory,
    violations,
)
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem
from planner.solver.solution import StagePlacement, VerifierPlacement
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
    golden_plan,
    solution,
)
from tests.unit.stepper_fixtures import assert_checks_share_the_device

torch.set_num_threads(1)

# Both boundaries of the untrusted middle stage on one verifier (the link tests' placement): it audits there.
BOTH_SIDES = (VerifierPlacement(boundary=0, device="verifier/0", directions=("act", "grad"), watch_only=("act",)),
              VerifierPlacement(boundary=1, device="verifier/0", directions=("act", "grad"), watch_only=("grad",)))
# ... without the gradient the last stage sends back: the auditor recomputes outputs only, at the step's end
OUTPUTS_ONLY = (BOTH_SIDES[0], VerifierPlacement(boundary=1, device="verifier/0", directions=("act",)))


def _small(every: int, verifiers: tuple[VerifierPlacement, ...] = BOTH_SIDES):
    """gpt-golden's shape: trusted ends, two untrusted replicas in the middle, 4 microbatches, 1 Gb/s."""
    ch = chain([block(i, fwd_flops=(i + 1) * 10**9, params=(i + 1) * 10**4) for i in range(5)], name="audit")
    cl = cluster([("trusted-a", TEST_DEVICE, 1), ("worker-b", TEST_DEVICE, 1), ("worker-c", SLOW_DEVICE, 1),
                  ("trusted-d", TEST_DEVICE, 1)], bandwidth_gbps=1.0, latency_ms=0.5, verifier_host=True,
                 trusted=("trusted-a", "trusted-d"))
    sol = solution([(0, 0), (1, 2), (3, 4)], [("trusted-a/0",), ("worker-b/0", "worker-c/0"), ("trusted-d/0",)],
                   4, splits=[(4,), (2, 2), (4,)], verifiers=verifiers)
    stages = tuple(dataclasses.replace(st, audit_every=every if st.index == 1 else 0) for st in sol.stages)
    return ch, cl, dataclasses.replace(sol, stages=stages)


def test_the_plans_audit_every_round_trips_and_old_plans_load_without_it():
    ch, cl, sol = _small(4)
    plan = compile_simple(ch, cl, sol)
    assert [st.audit_every for st in plan.stages] == [0, 4, 0]
    data = json.loads(json.dumps(plan.to_dict()))
    assert [st["audit_every"] for st in data["stages"]] == [0, 4, 0] and data["policy"]["audit_cost"] == 0.05
    assert Plan.from_dict(data) == plan
    old = golden_plan().to_dict()
    for st in old["stages"]:
        del st["audit_every"]
    del old["policy"]["audit_cost"]
    loaded = Plan.from_dict(json.loads(json.dumps(old)))
    assert all(st.audit_every == 0 for st in loaded.stages) and loaded.policy.audit_cost == 0.05
    bad = json.loads(json.dumps(plan.to_dict()))
    bad["stages"][1]["audit_every"] = -1
    with pytest.raises(InvalidInputError):
        Plan.from_dict(bad)


def test_the_policy_bounds_the_audit_share():
    assert VerificationPolicy.from_dict(VerificationPolicy(audit_cost=0.2).to_dict()).audit_cost == 0.2
    with pytest.raises(InvalidInputError):
        VerificationPolicy(audit_cost=-0.1)
    with pytest.raises(InvalidInputError):
        StagePlacement(index=0, first_block=0, last_block=0, devices=("a",), microbatches=(1,), audit_every=-4)


def test_the_audit_is_priced_as_the_runtime_does_it():
    link = Link(bandwidth_gbps=8.0, latency_ms=1.0)   # 1e9 bytes/s
    cost = audit_ms(every=4, microbatches=8, params=10**6, param_tensors=4, forward_ms=10.0, backward_ms=20.0,
                    output_bytes=1e6, input_bytes=1e6, source_link=link, digest_link=link,
                    verifier_mem_bw_bytes_per_s=1e10, optim_ms=3.0)
    assert cost.recompute_ms == pytest.approx(2 * (30.0 + 3 * 2e6 / 1e10 * 1e3))   # 2 of 8, forward and backward
    assert cost.gradient_ms == pytest.approx(1.0 + 4 * (10**6 + 4) / 1e9 * 1e3)     # float32 + a flag per tensor
    assert cost.digest_ms == pytest.approx(1.0 + 40 / 1e9 * 1e3)
    # auditing gradients too, it recomputes among its checks: it is done once it has heard the digests, sent after
    # the replicas' optimizer steps, and the gradient, which travels from the source's step's start (default: the
    # replicas' end) once the auditor has posted its receive; its copy steps on a thread of its own, off the path
    assert cost.during_step
    assert cost.end_ms(auditor_free_ms=100.0, replicas_done_ms=90.0) == pytest.approx(100.0 + cost.gradient_ms)
    assert cost.end_ms(auditor_free_ms=100.0, replicas_done_ms=200.0, gradient_sent_ms=150.0) == \
        pytest.approx(200.0 + cost.digest_ms)   # the gradient travelled during the source's optimizer step
    assert cost.end_ms(auditor_free_ms=100.0, replicas_done_ms=200.0, gradient_sent_ms=199.0) == \
        pytest.approx(199.0 + cost.gradient_ms)
    outputs = dataclasses.replace(cost, during_step=False)   # outputs only: it recomputes at the step's end
    assert outputs.end_ms(auditor_free_ms=100.0, replicas_done_ms=90.0) == \
        pytest.approx(100.0 + cost.recompute_ms + cost.digest_ms)   # the gradient came during the recompute
    assert outputs.end_ms(auditor_free_ms=0.0, replicas_done_ms=90.0) == pytest.approx(90.0 + cost.gradient_ms)
    assert not audit_ms(every=4, microbatches=8, params=1, param_tensors=1, forward_ms=1.0, output_bytes=1.0,
                        source_link=link, digest_link=link, verifier_mem_bw_bytes_per_s=1e10,
                        optim_ms=0.0).during_step
    with pytest.raises(InvalidInputError):
        audit_ms(every=0, microbatches=8, params=1, param_tensors=1, forward_ms=1.0, output_bytes=1.0,
                 source_link=link, digest_link=link, verifier_mem_bw_bytes_per_s=1e10, optim_ms=0.0)


def test_the_simulated_step_ends_when_the_auditor_has_heard_the_applied_gradient():
    """By hand: the verifier host (CPU) recomputes 1 of 4 microbatches of blocks 1-2 (a forward: outputs only)
    during the next step on its copy's stepper, beside its own checks, hears worker-b's 50,002 float32 values over
    1 Gb/s, then steps its copy with Adam on that thread."""
    ch, cl, sol = _small(0, OUTPUTS_ONLY)
    plain = compile_simple(ch, cl, sol)
    audited = compile_simple(ch, cl, _small(4, OUTPUTS_ONLY)[2])
    base, got = simulate(plain), simulate(audited)
    auditor, replicas = 4, (1, 2)   # the verifier-only rank comes last; worker-b (rank 1) sends the gradient
    spec = cl.device("verifier/0").spec
    cfg = config(4)
    recompute = compute.range_fwd_ms(ch, 1, 2, spec) + 1e3 * 3 * 2**16 / CPU_DEVICE["mem_bw_bytes_per_s"]
    gradient = 0.5 + 1e3 * 4 * (50_000 + 2) / 1.25e8
    digest = 0.5 + 1e3 * 40 / 1.25e8
    adam = optim_ms(50_000, cfg, spec, param_tensors=2)
    # outputs only: the last step's recompute, then the copy's step (Adam), on a thread of the auditor's from the
    # step's start (``AuditCost.deferred``), sharing the host with its checks (``audit_stepper.Stepper``): each check
    # lasts its own time plus what the stepper does beside it; the step's end waits for the stepper
    stepper = Stepper(parts=(StepperPart(stage=1, recompute=True, ms=recompute),
                             StepperPart(stage=1, recompute=False, ms=adam)))
    alone = assert_checks_share_the_device(base, got, auditor, stepper)
    assert stepper.ends[0] > alone[0].start_ms   # the recompute outlasts the fill: checks share the host with it
    end_of = {r: max(e.end_ms for e in got.events if e.rank == r and e.kind != "send" and "audit" not in e.label)
              for r in range(5)}
    stepping = min(e.start_ms for e in got.events if e.rank == 1 and e.kind == "optim")   # the source sends then
    heard = max(max(end_of[auditor], max(end_of[r] for r in replicas)) + digest,
                max(stepping, end_of[auditor]) + gradient, stepper.done_ms())
    expected = max(max(end_of.values()), heard)
    assert expected > base.step_ms
    assert got.step_ms == pytest.approx(expected, rel=1e-9)
    (step,) = [e for e in got.events if e.label == "stage 1 audit: copy's step (stepper)"]
    (again,) = [e for e in got.events if e.label == "stage 1 audit: last step's recompute (stepper)"]
    assert (again.rank, again.start_ms, again.end_ms) == (auditor, 0.0, pytest.approx(stepper.ends[0], rel=1e-9))
    assert (step.start_ms, step.end_ms) == (pytest.approx(stepper.ends[0], rel=1e-9),
                                            pytest.approx(stepper.ends[1], rel=1e-9))
    problem = build_problem(ch, cl, cfg, VerificationPolicy())
    priced = [price_program(problem, Placement(stages=stages, verifiers=OUTPUTS_ONLY, num_microbatches=4)).step_ms
              for stages in (sol.stages, _small(4, OUTPUTS_ONLY)[2].stages)]
    assert priced[1] - priced[0] == pytest.approx(expected - base.step_ms, rel=0.05)   # what the audit adds


def test_an_auditor_of_gradients_recomputes_among_its_checks():
    """Auditing gradients, it has a microbatch's four tensors once it has checked the gradient the replica
    sent upstream: each such check lasts a quarter of a recompute longer: a forward, the input gradient's share of
    the backward and, for a replica of two microbatches drawn whole (1 in 16 a step each), the weights' share."""
    ch, cl, sol = _small(0)
    spec = cl.device("verifier/0").spec
    backward = compute.range_bwd_ms(ch, 1, 2, spec)
    audited_bwd = backward * (INPUT_GRAD_SHARE + (1 - INPUT_GRAD_SHARE) * (2 * 2 / 16) / (4 / 4))
    assert audited_bwd == pytest.approx(audited_backward_ms(backward, every=4, replica_microbatches=(2, 2),
                                                            contributions=True))
    one = (compute.range_fwd_ms(ch, 1, 2, spec) + audited_bwd
           + 1e3 * 3 * (2 * 2**16) / CPU_DEVICE["mem_bw_bytes_per_s"])

    def checks(plan):
        return sorted(e.end_ms - e.start_ms for e in simulate(plan).events if e.label.startswith("0VERIFY_B"))

    plain, audited = checks(compile_simple(ch, cl, sol)), checks(compile_simple(ch, cl, _small(4)[2]))
    assert len(audited) == 4 and audited == pytest.approx([t + one / 4 for t in plain])


def _watched(home_gbps: float, latency_ms: float = 1.0):
    """Trusted fast GPUs at the ends (dc), two slow volunteers in the middle stage (home), 3M parameters
    there: its verifier on dc/1 holds both its boundaries; the dc-home link is ``home_gbps``, ``latency_ms``."""
    fast = {**TEST_DEVICE, "name": "TEST-FAST", "peak_flops": {"float32": 1.0e14}}
    slow = {**TEST_DEVICE, "name": "TEST-VOL", "peak_flops": {"float32": 1.0e12}}
    hosts = [{"name": "dc", "region": "dc", "trust": "op", "trusted": True,
              "devices": [{"type": "TEST-FAST", "spec": fast, "count": 2}]}]
    hosts += [{"name": f"v{i}", "region": "home", "trust": f"v{i}", "trusted": False,
               "devices": [{"type": "TEST-VOL", "spec": slow, "count": 1}]} for i in range(2)]
    fastlink = {"bandwidth_gbps": 100.0, "latency_ms": 0.1}
    cl = parse_cluster({"name": "watched", "hosts": hosts, "links": {
        "intra_host": fastlink, "default": fastlink,
        "regions": [{"between": ["dc", "home"], "bandwidth_gbps": home_gbps, "latency_ms": latency_ms}]}})
    ch = chain([block(i, params=10**6 if 1 <= i <= 3 else 10**4) for i in range(5)], name="watched")
    problem = build_problem(ch, cl, config(8), VerificationPolicy())
    stages = (StagePlacement(index=0, first_block=0, last_block=0, devices=("dc/0",), microbatches=(8,)),
              StagePlacement(index=1, first_block=1, last_block=3, devices=("v0/0", "v1/0"), microbatches=(4, 4)),
              StagePlacement(index=2, first_block=4, last_block=4, devices=("dc/1",), microbatches=(8,)))
    verifiers = tuple(dataclasses.replace(v, device="dc/1") for v in BOTH_SIDES)
    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=8)
    assert not violations(problem, placement)
    return problem, placement


def test_audits_are_chosen_where_the_auditor_hears_the_gradient_fast():
    problem, placement = _watched(100.0)
    chosen = choose_audits(problem, placement)
    assert [st.audit_every for st in chosen.stages] == [0, 4, 0]
    base = price_program(problem, with_audits(placement, {})).step_ms
    assert base < price_program(problem, chosen).step_ms <= 1.05 * base
    notes = audit_notes(problem, chosen)
    assert len(notes) == 1 and notes[0].startswith("stage 1: replicas audited by dc/1, one microbatch in 4")


def test_audits_stay_off_over_a_slow_link_to_the_auditor_and_the_plan_says_why():
    problem, placement = _watched(0.2)   # 12 MB of gradient a step: ~0.5 s, over the whole pipeline's step
    chosen = choose_audits(problem, with_audits(placement, {1: 4}))
    assert all(st.audit_every == 0 for st in chosen.stages)
    (note,) = audit_notes(problem, chosen)
    assert note.startswith("stage 1: replicas not audited: even one microbatch in 16 costs")
    assert "the applied gradient to dc/1 costs" in note and "over a 0.2 Gb/s link" in note


def test_a_stage_whose_input_its_auditor_does_not_verify_is_audited_from_the_upstream_stages_copies():
    """Boundary 1 verified on dc/0 (stage 0's device), boundary 0 on dc/1: the auditor dc/0 holds no input
    check, and the trusted stage 0 copies it the audited inputs (here itself: they are its own, nothing travels);
    the trusted stage 2 (dc/1) copies it the gradients it sent: input gradients audited too."""
    problem, placement = _watched(100.0)
    split = (placement.verifiers[0], dataclasses.replace(placement.verifiers[1], device="dc/0"))
    placement = dataclasses.replace(placement, verifiers=split)
    site = audit_site(problem, placement.stages, placement.verifiers, 1)
    assert site is not None and (site.auditor, site.grads, site.copied_from, site.grads_from) == \
        ("dc/0", False, ("dc/0",), ("dc/1",))
    chosen = choose_audits(problem, placement)
    assert [st.audit_every for st in chosen.stages] == [0, 4, 0]
    cost = audit_cost(problem, chosen.stages[1], site, 4, 8, upstream=chosen.stages[0], downstream=chosen.stages[2])
    # only the gradients dc/1 sent travel: 8 microbatches, one in 4 audited, float32
    down = copied_message_bytes(problem.raw_bytes(0), problem.raw_bytes(3), problem.elem_bytes, grads=True)[1]
    assert cost.copy_ms == pytest.approx(copy_ms(every=4, sent_microbatches=8, input_bytes=down,
                                                 link=problem.link("dc/1", "dc/0")))
    (note,) = audit_notes(problem, chosen)
    assert note.startswith("stage 1: replicas audited by dc/0, one microbatch in 4 (outputs and input gradients)"), note
    assert ("the audited inputs and the input gradients the replicas sent back come copied from stage 0 (dc/0) and "
            f"the gradients sent to them from stage 2 (dc/1) at the step's end in {cost.copy_ms:.1f} ms") in note


def test_audits_are_refused_where_the_auditors_copy_of_the_stage_would_not_fit_and_the_plan_says_why():
    problem, placement = _watched(100.0)
    st = placement.stages[1]
    site = audit_site(problem, placement.stages, placement.verifiers, 1)
    need = copy_bytes(problem, st, site)
    # 3M parameters of fp32 Adam (16 bytes each) and the applied gradient's 4: at least 60 MB; the auditor holds the
    # stage's gradients, so the replicas' contribution sums too (a float32 sum each, for two steps, and a microbatch's)
    assert site.grads and need >= problem.range_params(1, 3) * (16 + 4)
    assert need - copy_bytes(problem, st) == problem.range_params(1, 3) * 4 * (2 * len(st.devices) + 2)
    plain = with_audits(placement, {})
    held = dict(program_memory(problem, plain, price_program(problem, plain).in_flight))["dc/1"]
    cls = problem.class_of("dc/1")

    def with_room(room: int):
        classes = tuple(dataclasses.replace(c, mem_bytes=room) if c.index == cls else c for c in problem.classes)
        return dataclasses.replace(problem, classes=classes)

    assert [s.audit_every for s in choose_audits(with_room(held + need), placement).stages] == [0, 4, 0]
    tight = with_room(held + need - 1)
    assert all(s.audit_every == 0 for s in choose_audits(tight, placement).stages)
    (note,) = audit_notes(tight, placement)
    assert note.startswith("stage 1: replicas not audited: the copy its auditor dc/1 would keep"), note
    assert "does not fit" in note


@pytest.mark.parametrize("stage, codec", [(0, "int8"), (1, "fp8"), (1, "int4")])
def test_a_stage_with_a_compressed_boundary_is_never_audited_and_the_plan_says_why(stage, codec):
    """The auditor compares the decoded tensor with an uncompressed recompute: a codec's round trip alone
    (int8 ~0.007, fp8 up to 0.05, int4 up to 0.12) would fail honest replicas at fp32's tolerance 0.01."""
    problem, placement = _watched(100.0)
    stages = tuple(dataclasses.replace(st, out_codec=codec if st.index == stage else "none")
                   for st in placement.stages)
    placement = dataclasses.replace(placement, stages=stages)
    assert audit_site(problem, placement.stages, placement.verifiers, 1) is None
    assert all(st.audit_every == 0 for st in choose_audits(problem, placement).stages)
    (note,) = audit_notes(problem, placement)
    side = "input" if stage == 0 else "output"
    assert note.startswith(f"stage 1: replicas not audited: its {side} boundary travels {codec}-encoded"), note


@pytest.mark.parametrize("verifiers", [BOTH_SIDES, OUTPUTS_ONLY,
                                       (BOTH_SIDES[0], dataclasses.replace(BOTH_SIDES[1], device="trusted-a/0")),
                                       (dataclasses.replace(BOTH_SIDES[0], directions=("grad",), watch_only=()),
                                        BOTH_SIDES[1]),
                                       (dataclasses.replace(BOTH_SIDES[0], device="trusted-d/0", directions=("grad",),
                                                            watch_only=()), OUTPUTS_ONLY[1])])
def test_the_planner_and_the_compiled_plan_apply_one_audit_rule(verifiers):
    ch, cl, sol = _small(4, verifiers)
    problem = build_problem(ch, cl, config(4), VerificationPolicy())
    plan = compile_simple(ch, cl, sol)
    copied = []
    for k in range(plan.num_stages):
        site, where = audit_site(problem, sol.stages, sol.verifiers, k), plan_audit_site(plan, k)
        if site is None:
            assert isinstance(where, str) and where == audit_where(problem, sol.stages, sol.verifiers, k)
            continue
        assert isinstance(where, AuditWhere), where
        device = {r.rank: r.device for r in plan.ranks}
        assert (device[where.auditor], device[where.source], where.grads) == (site.auditor, site.source, site.grads)
        assert tuple(sorted(device[r] for r in where.copied_from)) == site.copied_from
        copied.append(bool(site.copied_from))
    # the link tests' placements hold the input; the others copy it from trusted-a
    assert copied == [verifiers[0].device != verifiers[1].device or "act" not in verifiers[0].directions]


def _random_audited(seed: int):
    """A random pool (``program_fixtures.untrusted_pool``) as trusted ends around its volunteers, replicated,
    verifiers keeping the link tests, the middle stage audited at a random share; or None."""
    rng = np.random.default_rng(seed)
    cl, ch, cfg, policy, problem = pf.untrusted_problem(rng, (6, 16))
    L, M = problem.num_blocks, problem.num_microbatches
    trusted = [d.id for d in cl.hosts[0].devices]
    untrusted = [d.id for h in cl.hosts[1:] for d in h.devices]
    cuts = sorted(rng.choice(np.arange(1, L), size=2, replace=False).tolist())
    groups = [trusted[:1], untrusted, trusted[1:]]
    stages = tuple(pf.stages_of(cuts, [len(g) for g in groups], [d for g in groups for d in g], L, M))
    verifiers = assign_verifiers(problem, stages, M, link=3)
    if len(untrusted) < 2 or verifiers is None:
        return None
    placement = with_audits(Placement(stages=stages, verifiers=verifiers, num_microbatches=M),
                            {1: int(rng.choice(EVERY_CHOICES))})
    if violations(problem, placement) or audit_site(problem, stages, verifiers, 1) is None:
        return None
    return pf._compiled(problem, placement, ch, cl, cfg, policy)


def test_audited_random_plans_are_priced_as_they_run():
    """Within 5% of the simulation on most draws, and never priced more than 5% under it (the planner would
    take audits dearer than the policy allows); a stage-device auditor's recomputes that the simulation fits
    into its idle time are priced as busy time (seed 9: 22% over)."""
    off = []
    for seed in range(24):
        got = _random_audited(seed)
        if got is not None:
            priced, plan = got
            assert plan.stages[1].audit_every > 0
            simulated = simulate(plan).step_ms
            off.append((priced.step_ms - simulated) / simulated)
    off = np.array(off)
    assert len(off) >= 18, len(off)
    assert np.mean(np.abs(off) <= 0.05) >= 0.9 and off.min() >= -0.05 and off.max() <= 0.25, sorted(off)


def test_a_recorded_input_gradient_share_is_priced_as_simulated_and_kept_by_the_plan():
    """Blocks that record their backward's split (``ir.Block.bwd_input_flops``): the audited stage's recompute
    follows it in the price and in the simulation alike (within 5%; a tenth: 48.9 priced, 50.4 simulated; nine
    tenths 60.9 both, 0.5's 54.9), and the plan carries it through JSON."""
    ch0, cl, sol = _small(4)
    steps = {}
    for share in (0.1, 0.9):
        ch = dataclasses.replace(ch0, blocks=tuple(dataclasses.replace(b, bwd_input_flops=round(share * b.bwd_flops))
                                                   for b in ch0.blocks))
        audited = compile_simple(ch, cl, sol)
        assert Plan.from_dict(json.loads(json.dumps(audited.to_dict()))) == audited
        assert [b.bwd_input_flops for b in audited.chain().blocks] == [b.bwd_input_flops for b in ch.blocks]
        problem = build_problem(ch, cl, config(4), VerificationPolicy())
        assert stage_input_grad_share(problem, 1, 2) == pytest.approx(share, rel=1e-3)
        priced = price_program(problem, Placement(stages=sol.stages, verifiers=BOTH_SIDES, num_microbatches=4))
        steps[share] = simulate(audited).step_ms
        assert priced.step_ms == pytest.approx(steps[share], rel=0.05)
    assert steps[0.9] > steps[0.1] * 1.1   # the share is what the auditor recomputes
