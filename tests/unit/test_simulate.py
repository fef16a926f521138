"""The simulator against closed forms, the solver objective and hand-computed timelines."""
from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
from plan_fixtures import (
    TEST_DEVICE,
    block,
    chain,
    cluster,
    compile_simple,
    config,
    free_cluster,
    solution,
    uniform_chain,
)

from cost_models import comm, compute, memory
from cost_models.devices import DeviceSpec
from cost_models.optim import optim_ms
from cost_models.training import TrainingConfig
from cost_models.verify import verify_ms
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel, stage_param_tensors
from planner.simulate import predict, simulate
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import VerifierPlacement

NO_CHECKS = VerificationPolicy(enabled=False)


def pipeline(ch, cl, S, M, schedule, *, devices=None, policy=NO_CHECKS, verifiers=()):
    per = len(ch.blocks) // S
    ranges = [(k * per, (k + 1) * per - 1) for k in range(S)]
    devices = devices or [(f"h{k}/0",) for k in range(S)]
    return compile_simple(ch, cl, solution(ranges, devices, M, schedule=schedule, verifiers=verifiers), policy)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(4, 8), (3, 2), (1, 4), (4, 4)])
def test_uniform_stages_free_communication_match_the_closed_form(schedule, S, M):
    # Boundary tensors of 0 bytes cost exactly 0 ms, so communication is free and the closed form is exact.
    ch = uniform_chain(2 * S, out_bytes=0)
    cl = free_cluster(S)
    result = simulate(pipeline(ch, cl, S, M, schedule))
    spec = cl.devices[0].spec
    t_f, t_b = compute.range_fwd_ms(ch, 0, 1, spec), compute.range_bwd_ms(ch, 0, 1, spec)
    assert result.pipeline_ms == pytest.approx((M + S - 1) * (t_f + t_b), rel=1e-12)
    assert result.bubble_fraction == pytest.approx((S - 1) / (M + S - 1), rel=1e-9, abs=1e-12)
    # the optimizer step follows: the same on every (uniform) stage
    opt = optim_ms(memory.stage_param_count(ch, 0, 1), config(M, schedule), spec)
    assert result.step_ms == pytest.approx(result.pipeline_ms + opt, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_huge_bandwidth_is_practically_free(schedule):
    ch = uniform_chain(8)  # 64 KiB boundaries over 1e9 Gb/s
    cl = free_cluster(4)
    spec = cl.devices[0].spec
    t = compute.range_fwd_ms(ch, 0, 1, spec) + compute.range_bwd_ms(ch, 0, 1, spec)
    assert simulate(pipeline(ch, cl, 4, 8, schedule)).pipeline_ms == pytest.approx(11 * t, rel=1e-9)


def test_heterogeneous_stages_against_the_solver_objective():
    """Stage times t_k = f_k + b_k of 0.6, 1.8, 1.2, 0.6 ms (b = 2 f), M = 8, free communication.

    The solver's objective sum_k t_k + (M - 1) max_k t_k = 4.2 + 7 * 1.8 = 16.8 ms.
    * GPipe equals it exactly: its forward phase is a flow shop of identical jobs,
      sum_k f_k + (M - 1) max_k f_k, and its backward phase likewise; since b is
      proportional to f the two maxima sit on the same stage and add up to max t.
    * 1F1B is 1.2 ms shorter: the objective charges every stage's full t_k as fill
      and drain, but the bottleneck (stage 1) overlaps its warm-up forwards with the
      round trip of microbatch 0 through stages 2-3. It still cannot beat the
      bottleneck's own work plus the fill before it and drain after it:
      M t_1 + f_0 + b_0 = 14.4 + 0.6 = 15.0 ms.
    """
    ch = chain([block(i, fwd_flops=f, out_bytes=0) for i, f in enumerate([10**9, 3 * 10**9, 2 * 10**9, 10**9])])
    cl = free_cluster(4)
    spec = cl.devices[0].spec
    f = [compute.range_fwd_ms(ch, k, k, spec) for k in range(4)]
    t = [f[k] + compute.range_bwd_ms(ch, k, k, spec) for k in range(4)]
    assert t == pytest.approx([0.6, 1.8, 1.2, 0.6])
    M = 8
    objective = sum(t) + (M - 1) * max(t)
    gpipe = simulate(pipeline(ch, cl, 4, M, "gpipe")).pipeline_ms
    one_f_one_b = simulate(pipeline(ch, cl, 4, M, "1f1b")).pipeline_ms
    assert gpipe == pytest.approx(objective, rel=1e-12)
    assert one_f_one_b == pytest.approx(objective - 1.2, rel=1e-12)
    assert one_f_one_b >= M * t[1] + t[0]


def test_transfers_cost_latency_plus_bytes_over_bandwidth():
    ch = uniform_chain(2, out_bytes=10**6)
    cl = free_cluster(2)
    slow = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1)], bandwidth_gbps=1.0, latency_ms=5.0)
    spec = cl.devices[0].spec
    f, b = compute.range_fwd_ms(ch, 0, 0, spec), compute.range_bwd_ms(ch, 0, 0, spec)
    transfer = comm.transfer_ms(10**6, slow.link("h0/0", "h1/0"))
    assert transfer == pytest.approx(5.0 + 8.0)
    result = simulate(pipeline(ch, slow, 2, 1, "1f1b"))
    assert result.pipeline_ms == pytest.approx(2 * (f + b) + 2 * transfer, rel=1e-12)
    sends = [e for e in result.events if e.kind == "send"]
    assert [(e.rank, e.peer) for e in sends] == [(0, 1), (1, 0)]


def test_one_link_carries_one_transfer_at_a_time():
    ch = uniform_chain(2, fwd_flops=10**6, out_bytes=10**6)  # compute is negligible next to a 13 ms transfer
    slow = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1)], bandwidth_gbps=1.0, latency_ms=5.0)
    result = simulate(pipeline(ch, slow, 2, 4, "gpipe"))
    arrivals = sorted(e.end_ms for e in result.events if e.kind == "send" and e.rank == 0)
    first = arrivals[0]
    # each message holds the link for its 8 ms of bytes; the 5 ms latency overlaps the next one
    assert arrivals == pytest.approx([first + 8.0 * i for i in range(4)], rel=1e-9)


class SlowVerifier(CostModel):
    """The plan's prices with every verification taking ``verify`` ms."""

    verify = 0.0

    def verify_ms(self, rank, boundary, op):
        return self.verify


def _verified_pair(M=1):
    ch = uniform_chain(2, out_bytes=10**6)
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1)], verifier_host=True, trusted=("h1",))
    ver = (VerifierPlacement(boundary=0, device="verifier/0", directions=("act",)),)
    return cl, pipeline(ch, cl, 2, M, "1f1b", policy=VerificationPolicy(), verifiers=ver)


def test_verification_is_priced_on_the_verifier_and_the_verdict_gates_the_consumers_backward():
    cl, plan = _verified_pair()
    result = simulate(plan)
    verifier_spec = cl.device("verifier/0").spec
    (box,) = [e for e in result.events if e.kind == "verify"]
    assert box.rank == 2 and box.end_ms - box.start_ms == pytest.approx(verify_ms(10**6, verifier_spec))
    (send,) = [e for e in result.events if e.kind == "send" and e.rank == 0 and e.peer == 1]
    (consumer_f,) = [e for e in result.events if e.kind == "F" and e.rank == 1]
    (consumer_b,) = [e for e in result.events if e.kind == "B" and e.rank == 1]
    verdict_ms = comm.transfer_ms(16, cl.link("verifier/0", "h1/0"))
    # deferred: the forward runs on the activation as it arrives; the last stage's backward waits for the verdict
    assert consumer_f.start_ms == pytest.approx(send.end_ms, rel=1e-12)
    assert consumer_b.start_ms == pytest.approx(max(consumer_f.end_ms, box.end_ms + verdict_ms), rel=1e-12)
    unchecked = simulate(pipeline(uniform_chain(2, out_bytes=10**6), cl, 2, 1, "1f1b"))
    fast = SlowVerifier.for_plan(plan)
    fast.verify = 1e-3  # ms: a check far shorter than the forward
    hidden = simulate(plan, fast)
    (box,) = [e for e in hidden.events if e.kind == "verify"]
    (consumer_f,) = [e for e in hidden.events if e.kind == "F" and e.rank == 1]
    assert box.end_ms + verdict_ms < consumer_f.end_ms  # this verdict is hidden behind the forward
    assert hidden.step_ms == pytest.approx(unchecked.step_ms, rel=1e-12)
    slow = SlowVerifier.for_plan(plan)
    slow.verify = 1.0  # ms: longer than the forward
    delayed = simulate(plan, slow)
    (box,) = [e for e in delayed.events if e.kind == "verify"]
    (consumer_b,) = [e for e in delayed.events if e.kind == "B" and e.rank == 1]
    assert consumer_b.start_ms == pytest.approx(box.end_ms + verdict_ms, rel=1e-12)
    assert delayed.step_ms > unchecked.step_ms


def test_a_slow_verifier_delays_the_send_not_the_pass():
    """A 3-stage pipeline with the activation into stage 1 verified: stage 1's forward of a microbatch
    runs when the activation arrives, whatever the verifier takes; its send of that microbatch to
    stage 2 waits for the verdict. The verifier's latency overlaps the forward."""
    ch = uniform_chain(3, out_bytes=10**6)
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1), ("h2", TEST_DEVICE, 1)], verifier_host=True,
                 trusted=("h1", "h2"))
    ver = (VerifierPlacement(boundary=0, device="verifier/0", directions=("act",)),)
    plan = pipeline(ch, cl, 3, 1, "1f1b", policy=VerificationPolicy(), verifiers=ver)
    fwd = CostModel.for_plan(plan).compute_ms(1, "F")
    timelines = {}
    for verify in (0.0, 0.5 * fwd, 4.0 * fwd):
        costs = SlowVerifier.for_plan(plan)
        costs.verify = verify
        result = simulate(plan, costs)
        (f1,) = [e for e in result.events if e.kind == "F" and e.rank == 1]
        (send,) = [e for e in result.events if e.kind == "send" and e.rank == 1 and e.peer == 2]
        (check,) = [e for e in result.events if e.kind == "verify"]
        verdict_at = check.end_ms + costs.verdict_ms(check.rank, 1)
        timelines[verify] = (f1.start_ms, f1.end_ms, send.start_ms, verdict_at, result.step_ms)
    starts = {v: t[0] for v, t in timelines.items()}
    assert len(set(starts.values())) == 1  # the pass never waits for the verifier
    fast, overlapped, slow = (timelines[v] for v in (0.0, 0.5 * fwd, 4.0 * fwd))
    assert fast[2] == pytest.approx(fast[1]) and overlapped[2] == pytest.approx(overlapped[1])  # hidden by F
    assert overlapped[4] == pytest.approx(fast[4])
    assert slow[3] > slow[1] and slow[2] == pytest.approx(slow[3])  # the send waits for the verdict
    assert slow[4] > fast[4]


def test_deferred_verdicts_wait_where_the_microbatch_moves_on():
    from planner.instructions import parse_program
    from planner.simulate_run import deferred_verdicts

    middle = parse_program(["1RECV_F0<0", "1VERDICT_F0<9", "1F0", "1SEND_F0>2", "1RECV_B0<2", "1VERDICT_B0<9",
                            "1B0", "1SEND_B0>0", "1OPTIM"])
    assert deferred_verdicts(middle) == {3: (1,), 7: (5,)}
    last = parse_program(["2RECV_F0<1", "2VERDICT_F0<9", "2F0", "2B0", "2SEND_B0>1", "2OPTIM"])
    assert deferred_verdicts(last) == {3: (1,)}
    first = parse_program(["0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0RECV_B0<1", "0VERDICT_B0<9", "0B0",
                           "0RECV_B1<1", "0VERDICT_B1<9", "0B1", "0ALLREDUCE", "0OPTIM"])
    assert deferred_verdicts(first) == {9: (5,), 10: (8,)}  # one held backward at a time, as the executor


def test_verify_ms_formula():
    """The measured fit (cost_models.verify): a fixed 1.5 ms and 50 passes over the tensor's bytes."""
    spec = free_cluster(1).devices[0].spec
    assert verify_ms(0, spec) == pytest.approx(1.5)
    assert verify_ms(10**9, spec) - verify_ms(0, spec) == pytest.approx(1e3 * 50 * 10**9 / spec.mem_bw_bytes_per_s)
    vm = dataclasses.replace(spec, mem_bw_bytes_per_s=32e9)  # the VM the fit was measured on
    assert verify_ms(3 * 2**20, vm) == pytest.approx(6.6, rel=0.05)


def test_replicated_stage_all_reduces_its_gradients():
    ch = uniform_chain(2)
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 2)], bandwidth_gbps=10.0, latency_ms=1.0)
    plan = pipeline(ch, cl, 2, 4, "1f1b", devices=[("h0/0",), ("h1/0", "h1/1")])
    result = simulate(plan)
    boxes = [e for e in result.events if e.kind == "allreduce"]
    assert sorted(e.rank for e in boxes) == [1, 2]
    assert boxes[0].start_ms == boxes[1].start_ms and boxes[0].end_ms == boxes[1].end_ms
    grads = memory.stage_param_count(ch, 1, 1) * 4
    expected = comm.group_allreduce_ms(cl, ["h1/0", "h1/1"], grads)
    assert boxes[0].end_ms - boxes[0].start_ms == pytest.approx(expected)
    assert expected > 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_memory_follows_the_activations_actually_in_flight(schedule):
    S, M = 4, 8
    ch = uniform_chain(4, saved_act_bytes=10**7)
    plan = pipeline(ch, free_cluster(S), S, M, schedule)
    result = simulate(plan)
    costs = CostModel.for_plan(plan)
    for k in range(S):
        expected_in_flight = M if schedule == "gpipe" else min(S - k, M)
        assert result.peak_in_flight[k] == expected_in_flight == plan.ranks[k].max_in_flight
        br = memory.stage_memory(ch, k, k, plan.config, expected_in_flight)
        assert result.peak_mem_bytes[k] == br.total_bytes == costs.memory_bytes(k, expected_in_flight)
    assert plan.predicted.peak_mem_bytes == result.peak_mem_bytes


def test_timeline_is_consistent():
    ch = uniform_chain(6)
    plan = pipeline(ch, free_cluster(3), 3, 5, "1f1b")
    result = simulate(plan)
    for rank in range(plan.num_ranks):
        boxes = sorted((e for e in result.events if e.rank == rank and e.kind != "send"), key=lambda e: e.start_ms)
        assert all(a.end_ms <= b.start_ms + 1e-12 for a, b in pairwise(boxes))  # a rank does one thing
        assert sorted((e.kind, e.mb) for e in boxes if e.kind in ("F", "B")) == \
            sorted((d, m) for d in "BF" for m in range(5))
    assert all(b + i == pytest.approx(result.step_ms) for b, i in zip(result.busy_ms, result.idle_ms))
    assert result.predicted().step_ms == result.step_ms


def test_a_saved_plan_simulates_to_its_prediction(tmp_path):
    """The plan file alone reproduces the prediction, also for a chain rescaled to another microbatch size."""
    import dataclasses

    from plan_fixtures import model_ref

    from planner.compile import compile_plan
    from planner.plan_load import load_plan

    ch = uniform_chain(4, out_bytes=10**6)
    scaled = dataclasses.replace(ch, microbatch_size=4)  # as if the solver rescaled a chain traced at 2
    ref = model_ref(ch)
    cl = cluster([(f"h{i}", TEST_DEVICE, 1) for i in range(2)], bandwidth_gbps=10.0, latency_ms=1.0)
    sol = solution([(0, 1), (2, 3)], [("h0/0",), ("h1/0",)], 4)
    # untrusted hosts and no verifiers: the plan says verification is off, else loading refuses it
    plan = predict(compile_plan(sol, scaled, cl, config(4, microbatch_size=4), VerificationPolicy(enabled=False), ref))
    assert plan.model.batch == 2 and plan.chain_microbatch_size == 4
    loaded = load_plan(plan.save(tmp_path / "plan.json"))
    assert simulate(loaded).predicted() == plan.predicted


def _boxes(result, tf):
    return {e.label: (e.start_ms / tf, e.end_ms / tf) for e in result.events if e.kind in ("F", "B")}


def test_ranks_sharing_fewer_cores_split_them_evenly():
    """1F1B, S = 4, M = 4, b = 2 f, no parameters and free communication, on 2 shared cores.

    The pipeline fills as usual until three forwards overlap at t = 2 f: each gets 2/3
    of a core, so a forward takes 1.5 f (until 3.5 f); then four overlap and each takes
    2 f (until 5.5 f); the last stage's first backward then runs alone at full speed."""
    ch = uniform_chain(8, out_bytes=0, params=0)
    plan = pipeline(ch, free_cluster(4), 4, 4, "1f1b")
    tf = compute.range_fwd_ms(ch, 0, 1, free_cluster(1).devices[0].spec)
    boxes = _boxes(simulate(plan, cores=2), tf)
    assert boxes["0F1"] == pytest.approx((1.0, 2.0)) and boxes["1F0"] == pytest.approx((1.0, 2.0))
    for label in ("0F2", "1F1", "2F0"):
        assert boxes[label] == pytest.approx((2.0, 3.5))
    for label in ("0F3", "1F2", "2F1", "3F0"):
        assert boxes[label] == pytest.approx((3.5, 5.5))
    assert boxes["3B0"] == pytest.approx((5.5, 7.5))
    shared = simulate(plan, cores=2)
    assert simulate(plan).pipeline_ms < shared.pipeline_ms < simulate(plan, cores=1).pipeline_ms
    assert shared.pipeline_ms == pytest.approx(27 * tf)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_shared_core_runs_all_the_work_back_to_back(schedule):
    # free communication: some pass can always run, so the core never idles
    ch = uniform_chain(8, out_bytes=0)
    plan = pipeline(ch, free_cluster(4), 4, 4, schedule)
    costs = CostModel.for_plan(plan)
    work = sum(4 * (costs.compute_ms(r, "F") + costs.compute_ms(r, "B")) + costs.optim_ms(r) for r in range(4))
    assert simulate(plan, cores=1).step_ms == pytest.approx(work, rel=1e-12)


def test_enough_cores_or_one_microbatch_is_the_plain_simulation():
    ch = uniform_chain(8)
    cl = cluster([(f"h{i}", TEST_DEVICE, 1) for i in range(4)], bandwidth_gbps=10.0, latency_ms=1.0)
    plan = pipeline(ch, cl, 4, 4, "1f1b")
    assert simulate(plan, cores=4) == simulate(plan) == simulate(plan, cores=64)
    single = pipeline(ch, cl, 4, 1, "1f1b")  # one microbatch: the stages never compute at once
    assert simulate(single, cores=1).step_ms == pytest.approx(simulate(single).step_ms, rel=1e-12)
    with pytest.raises(InvalidInputError):
        simulate(plan, cores=0)


def test_optimizer_step_pays_the_per_op_overhead_on_every_parameter_tensor():
    spec = DeviceSpec.from_dict({**TEST_DEVICE, "op_overhead_ms": 0.01})
    cfg = config(4)
    base = optim_ms(10**6, cfg, spec)
    assert optim_ms(10**6, cfg, spec, param_tensors=50) == pytest.approx(base + 50 * 9 * 0.01)
    sgd = TrainingConfig(global_batch=8, microbatch_size=2, schedule="1f1b", optimizer="sgd")
    assert optim_ms(10**6, sgd, spec, param_tensors=50) == pytest.approx(optim_ms(10**6, sgd, spec) + 50 * 0.01)
    # a profile's measured optimizer kernel cost replaces the model ops' overhead for the step's kernels
    measured = DeviceSpec.from_dict({**TEST_DEVICE, "op_overhead_ms": 0.01, "optim_op_ms": 0.002})
    assert optim_ms(10**6, cfg, measured, param_tensors=50) == pytest.approx(base + 50 * 9 * 0.002)
    ch = uniform_chain(4)  # one parameter tensor per block
    assert stage_param_tensors(ch, 1, 3) == 3


def test_measured_core_sharing_slows_the_passes_that_overlap():
    """1F1B, S = 2, M = 2, b = 2 f, free communication, 2 cores on which two passes at once each
    progress at 0.8 of one alone (as measured on a machine whose cores share an execution unit).

    Rank 0's F0 runs alone [0, 1]; F1 and rank 1's F0 overlap from 1 and end at 1 + 1 / 0.8 = 2.25;
    rank 1's B0 runs alone until 4.25; then rank 0's B0 (2) and rank 1's F1 (1) overlap: F1 ends at
    5.5 with B0 1 f short; B0 overlaps rank 1's B1 and ends at 5.5 + 1 / 0.8 = 6.75, B1 (1 f left)
    ends alone at 7.75, and rank 0's B1 runs alone until 9.75."""
    from cost_models.measured import CoreSharing

    ch = uniform_chain(4, out_bytes=0, params=0)
    plan = pipeline(ch, free_cluster(2), 2, 2, "1f1b")
    tf = compute.range_fwd_ms(ch, 0, 1, free_cluster(1).devices[0].spec)
    measured = simulate(plan, cores=2, sharing=CoreSharing(cores=2, speed=(1.0, 0.8)))
    assert measured.pipeline_ms == pytest.approx(9.75 * tf)
    boxes = _boxes(measured, tf)
    assert boxes["0F1"] == pytest.approx((1.0, 2.25)) and boxes["1F0"] == pytest.approx((1.0, 2.25))
    assert boxes["0B0"] == pytest.approx((4.25, 6.75)) and boxes["1B1"] == pytest.approx((5.5, 7.75))
    # a table of perfect sharing is the plain simulation; one that halves two passes is one core
    assert simulate(plan, cores=2, sharing=CoreSharing(cores=2, speed=(1.0, 1.0))).step_ms == \
        pytest.approx(simulate(plan).step_ms, rel=1e-12)
    assert simulate(plan, cores=2, sharing=CoreSharing(cores=2, speed=(1.0, 0.5))).step_ms == \
        pytest.approx(simulate(plan, cores=1).step_ms, rel=1e-12)
    with pytest.raises(InvalidInputError):
        simulate(plan, sharing=CoreSharing(cores=2, speed=(1.0, 0.8)))  # a table needs the cores it is for


def test_an_emulated_slower_device_pads_without_holding_a_core():
    """S = 2, M = 2, 1F1B on one shared core; rank 1's device is 3x slower and rehearsed by padding.

    Rank 0's F0 [0, 1]; F1 and rank 1's F0 (1 f of work, padded to 3) share the core: both finish their
    work at 3, F0 then sleeps until 4; rank 1's B0 computes 2 alone and sleeps until 10; rank 0's B0
    and rank 1's F1 share the core from 10 (F1's work done at 12, padded to 13; B0's at 13); rank 1's
    B1 computes until 15 and sleeps until 19; rank 0's B1 runs [19, 21]."""
    third = {**TEST_DEVICE, "name": "TEST-THIRD", "efficiency": TEST_DEVICE["efficiency"] / 3}
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", third, 1)])
    ch = uniform_chain(4, out_bytes=0, params=0)
    plan = pipeline(ch, cl, 2, 2, "1f1b")
    costs = CostModel.for_plan(plan)
    tf = costs.compute_ms(0, "F")
    assert costs.compute_ms(1, "F") == pytest.approx(3 * tf) and costs.local_ms(1, "F") == pytest.approx(tf)
    assert costs.local_ms(0, "B") == costs.compute_ms(0, "B")
    emulated = simulate(plan, cores=1, emulated=True)
    assert emulated.pipeline_ms == pytest.approx(21 * tf)
    boxes = _boxes(emulated, tf)
    assert boxes["1F0"] == pytest.approx((1.0, 4.0)) and boxes["1B0"] == pytest.approx((4.0, 10.0))
    # padding on a core of its own is the plain simulation; here the slow rank's sleeps leave the one core
    # to rank 0 at the right times, so the plain timeline survives; a core held while padding is slower
    assert simulate(plan, cores=2, emulated=True).step_ms == pytest.approx(simulate(plan).step_ms, rel=1e-12)
    assert emulated.pipeline_ms == pytest.approx(simulate(plan).pipeline_ms, rel=1e-12)
    assert simulate(plan, cores=1).pipeline_ms > emulated.pipeline_ms


def test_core_sharing_rates_extrapolate_the_last_measured_throughput():
    from cost_models.measured import CoreSharing

    table = CoreSharing(cores=2, speed=(1.0, 0.8, 0.5))
    assert [table.rate(k) for k in (0, 1, 2, 3)] == [0.0, 1.0, 0.8, 0.5]
    assert table.rate(6) == pytest.approx(0.5 * 3 / 6)  # 1.5 cores' worth, shared by six
    for bad in ((), (0.9, 0.8), (1.0, 1.3), (1.0, 0.0)):
        with pytest.raises(InvalidInputError):
            CoreSharing(cores=2, speed=bad)
    with pytest.raises(InvalidInputError):
        CoreSharing(cores=0, speed=(1.0,))
    assert CoreSharing.from_dict(table.to_dict()) == table


def test_emulated_padding_follows_the_cpu_time_a_slowed_core_gave_the_pass():
    """As the runtime pads (factor x the pass's CPU time): on 2 cores where two passes at once each run
    at 0.8, rank 1's (3x slower) F0 overlapping rank 0's F1 from 1 f computes 1 f of work in 1.25 f of
    CPU time and is padded to 3 x 1.25: [1, 4.75]. Its B0 runs alone (2 f, padded to 6 f: until 10.75);
    F1 overlaps rank 0's B0 ([10.75, 14.5]); B1 alone until 20.5; rank 0's B1 ends at 22.5."""
    from cost_models.measured import CoreSharing

    third = {**TEST_DEVICE, "name": "TEST-THIRD", "efficiency": TEST_DEVICE["efficiency"] / 3}
    plan = pipeline(uniform_chain(4, out_bytes=0, params=0), cluster([("h0", TEST_DEVICE, 1), ("h1", third, 1)]),
                    2, 2, "1f1b")
    tf = CostModel.for_plan(plan).compute_ms(0, "F")
    result = simulate(plan, cores=2, sharing=CoreSharing(cores=2, speed=(1.0, 0.8)), emulated=True)
    boxes = _boxes(result, tf)
    assert boxes["1F0"] == pytest.approx((1.0, 4.75)) and boxes["0F1"] == pytest.approx((1.0, 2.25))
    assert boxes["1F1"] == pytest.approx((10.75, 14.5)) and boxes["0B0"] == pytest.approx((10.75, 13.0))
    assert result.pipeline_ms == pytest.approx(22.5 * tf)


def test_messages_cost_each_end_its_cpu_time_before_sending_and_after_arriving():
    """S = 2, M = 1, free links: rank 0's F, its send's CPU time s, rank 1's receive r (after arrival),
    rank 1's F and B, its send s, rank 0's receive r, rank 0's B: 2 (f + b) + 2 (s + r)."""
    from cost_models.measured import MessageCost

    plan = pipeline(uniform_chain(2, out_bytes=2**20), free_cluster(2), 2, 1, "1f1b")
    costs = CostModel.for_plan(plan)
    cost = MessageCost(send_ms=0.5, recv_ms=0.25, send_ms_per_mib=1.0, recv_ms_per_mib=2.0)
    nbytes = costs.boundary_bytes[0]
    s, r = 0.5 + nbytes / 2**20, 0.25 + 2.0 * nbytes / 2**20
    assert cost.send_cpu_ms(nbytes) == pytest.approx(s) and cost.recv_cpu_ms(nbytes) == pytest.approx(r)
    plain = simulate(plan)
    priced = simulate(plan, messages=cost)
    assert priced.pipeline_ms == pytest.approx(plain.pipeline_ms + 2 * (s + r), rel=1e-9)
    boxes = sorted((e.start_ms, e.rank, e.label.split()[0], e.end_ms - e.start_ms)
                   for e in priced.events if e.kind == "message")
    assert [b[1:3] for b in boxes] == [(0, "0SEND_F0>1"), (1, "1RECV_F0<0"), (1, "1SEND_B0>0"), (0, "0RECV_B0<1")]
    assert [b[3] for b in boxes] == pytest.approx([s, r, s, r])
    # the messages' CPU time is busy time of their ranks; free messages are the plain simulation
    assert priced.busy_ms[0] == pytest.approx(plain.busy_ms[0] + s + r, rel=1e-9)
    assert simulate(plan, messages=MessageCost(send_ms=0.0, recv_ms=0.0)).step_ms == pytest.approx(plain.step_ms)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_messages_on_one_shared_core_add_their_cpu_time_to_the_work(schedule):
    # free links: the one core never idles, so the step is all passes plus every message's two ends
    from cost_models.measured import MessageCost

    S, M = 4, 4
    plan = pipeline(uniform_chain(8, out_bytes=0), free_cluster(S), S, M, schedule)
    costs = CostModel.for_plan(plan)
    work = sum(M * (costs.compute_ms(r, "F") + costs.compute_ms(r, "B")) + costs.optim_ms(r) for r in range(S))
    cost = MessageCost(send_ms=0.3, recv_ms=0.2)
    messages = 2 * (S - 1) * M  # forward and backward across every boundary, per microbatch
    assert simulate(plan, cores=1, messages=cost).step_ms == pytest.approx(work + messages * 0.5, rel=1e-12)
    # on shared cores a message's CPU time slows the passes it overlaps; never faster than without it
    assert simulate(plan, cores=2, messages=cost).step_ms > simulate(plan, cores=2).step_ms
