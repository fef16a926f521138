"""What each instruction of a plan costs on its device: compute, transfers, checks, memory.

One cost table for the list scheduler that lowers a solution to programs
(``planner.schedules``) and for the simulator that runs them
(``planner.simulate``), so both see the same durations.
"""
from __future__ import annotations

from dataclasses import replace

from cost_models import comm, compute, memory
from cost_models.cluster import ClusterSpec, Link
from cost_models.codecs import (
    ALLREDUCE_STATE_BYTES_PER_PARAM,
    codec_ms,
    int8_allreduce_ms,
    powersgd_allreduce_ms,
    wire_bytes,
)
from cost_models.devices import DeviceSpec
from cost_models.memory import activation_scale
from cost_models.optim import optim_ms
from cost_models.training import TrainingConfig
from cost_models.verify import BLAME_MS, VERDICT_BYTES, verify_ms
from planner.errors import InvalidInputError
from planner.ir import BlockChain, dtype_bytes
from planner.plan import Plan
from planner.plan_values import RankInfo, VerifierInfo


def stage_param_tensors(chain: BlockChain, lo: int, hi: int) -> int:
    """Parameter tensors of blocks ``lo..hi`` (each block lists the parameters it reads)."""
    return len({name for b in chain.blocks[lo:hi + 1] for name in b.param_names})


class CostModel:
    """Prices of every instruction for one rank layout (also the list scheduler's estimates)."""

    def __init__(self, *, chain: BlockChain, stage_ranges: tuple[tuple[int, int], ...],
                 ranks: tuple[RankInfo, ...], verifiers: tuple[VerifierInfo, ...], cluster: ClusterSpec,
                 config: TrainingConfig, recompute: tuple[bool, ...] = (), codecs: tuple[str, ...] = (),
                 allreduce_codecs: tuple[str, ...] = ()) -> None:
        """``recompute``: per stage, whether its backward runs its forward again (default: none does);
        ``codecs``: per stage, its output boundary's codec (``cost_models.codecs``; default: none);
        ``allreduce_codecs``: per stage, its replicas' gradient all-reduce codec (default: none)."""
        self.chain, self.ranks, self.cluster, self.config = chain, ranks, cluster, config
        self.ranges = stage_ranges
        self.recompute = recompute or (False,) * len(stage_ranges)
        self._links: dict[tuple[int, int], Link] = {}
        dtype, traced = config.dtype, memory.trace_dtype(chain)
        scale = activation_scale(chain, config)
        # Bytes crossing boundary b (stage b -> b+1), either direction: decoded, and on the wire.
        self.boundary_bytes = tuple(chain.blocks[hi].out_bytes * scale for _, hi in stage_ranges[:-1])
        self.codecs = codecs or ("none",) * len(stage_ranges)
        self.allreduce_codecs = allreduce_codecs or ("none",) * len(stage_ranges)
        self.wire_bytes = tuple(wire_bytes(c, b, dtype_bytes(dtype)) for c, b in zip(self.codecs, self.boundary_bytes))
        self.spec = tuple(cluster.device(r.device).spec for r in ranks)
        planned = {spec for r, spec in zip(ranks, self.spec) if r.stage is not None}
        self._fwd, self._bwd, self._optim, self._local = [], [], [], []
        for r, spec in zip(ranks, self.spec):
            if r.stage is None:  # a verifier-only rank computes no stage
                for table in (self._fwd, self._bwd, self._optim):
                    table.append(0.0)
                self._local.append((0.0, 0.0))
                continue
            lo, hi = stage_ranges[r.stage]
            enc_f, enc_b = self._codec_ms(r.stage, spec)
            fwd = compute.range_fwd_ms(chain, lo, hi, spec, dtype, trace_dtype=traced)
            self._fwd.append(fwd + enc_f)
            again = fwd if self.recompute[r.stage] else 0.0  # the checkpointed forward runs again
            self._bwd.append(compute.range_bwd_ms(chain, lo, hi, spec, dtype, trace_dtype=traced) + again + enc_b)
            self._optim.append(optim_ms(memory.stage_param_count(chain, lo, hi), config, spec,
                                        param_tensors=stage_param_tensors(chain, lo, hi)))
            # What an emulating rehearsal computes for this stage: its cost on the fastest planned
            # device (planner.runtime.rank.emulate's reference); the rest of the pass is padding.
            self._local.append(min(((f := compute.range_fwd_ms(chain, lo, hi, s, dtype, trace_dtype=traced),
                                     compute.range_bwd_ms(chain, lo, hi, s, dtype, trace_dtype=traced)
                                     + (f if self.recompute[r.stage] else 0.0))
                                    for s in planned), key=sum))
        self.verified = {r.rank: tuple((v.boundary, d) for v in verifiers if v.rank == r.rank
                                       for d in v.directions) for r in ranks}
        self.measured_checks: dict[tuple[int, str], float] = {}  # (boundary, F/B) -> ms, timed where it runs
        self.blame_ms = BLAME_MS  # a verifier's end-of-step flags and blame

    def _codec_ms(self, stage: int, spec: DeviceSpec) -> tuple[float, float]:
        """A stage pass's encoding and decoding: forward, its output's encode and its input's decode;
        backward, the returning gradient's decode and the one it sends back's encode."""
        out = (self.codecs[stage], self.boundary_bytes[stage]) if stage < len(self.boundary_bytes) else ("none", 0.0)
        into = (self.codecs[stage - 1], self.boundary_bytes[stage - 1]) if stage > 0 else ("none", 0.0)

        def ms(codec: str, nbytes: float, op: str, direction: str) -> float:
            return codec_ms(codec, nbytes, spec.mem_bw_bytes_per_s, op, op_overhead_ms=spec.op_overhead_ms,
                            kind=spec.kind, direction=direction)

        fwd = ms(*out, "encode", "F") + ms(*into, "decode", "F")
        bwd = ms(*out, "decode", "B") + ms(*into, "encode", "B")
        return fwd, bwd

    def _link(self, src: int, dst: int) -> Link:
        key = (src, dst)
        if key not in self._links:  # cluster.link resolves host/region tables: memoise per rank pair
            self._links[key] = self.cluster.link(self.ranks[src].device, self.ranks[dst].device)
        return self._links[key]

    # --- StepCosts protocol (planner.schedules) ---------------------------
    def compute_ms(self, rank: int, op: str) -> float:
        return self._fwd[rank] if op == "F" else self._bwd[rank]

    def local_ms(self, rank: int, op: str) -> float:
        """The pass on the fastest planned device for the rank's stage: what a rehearsal that emulates
        the rank's slower device computes before it pads the pass to :meth:`compute_ms`."""
        fwd, bwd = self._local[rank]
        return min(fwd if op == "F" else bwd, self.compute_ms(rank, op))

    def transfer_ms(self, src: int, dst: int, stage: int, op: str) -> float:
        boundary = stage if op == "F" else stage - 1
        return comm.transfer_ms(self.wire_bytes[boundary], self._link(src, dst))

    def verify_ms(self, rank: int, boundary: int, op: str) -> float:
        measured = self.measured_checks.get((boundary, op))
        return measured if measured is not None else verify_ms(self.boundary_bytes[boundary], self.spec[rank])

    def verdict_ms(self, src: int, dst: int) -> float:
        return comm.transfer_ms(VERDICT_BYTES, self._link(src, dst))

    # --- the rest ---------------------------------------------------------
    def message_ms(self, kind: str, boundary: int, src: int, dst: int) -> float:
        nbytes = VERDICT_BYTES if kind.startswith("V") else self.wire_bytes[boundary]
        return comm.transfer_ms(nbytes, self._link(src, dst))

    def latency_ms(self, src: int, dst: int) -> float:
        return self._link(src, dst).latency_ms

    def optim_ms(self, rank: int) -> float:
        return self._optim[rank]

    def allreduce_ms(self, stage: int) -> float:
        lo, hi = self.ranges[stage]
        params = memory.stage_param_count(self.chain, lo, hi)
        devices = [r.device for r in self.ranks if r.stage == stage]
        if self.allreduce_codecs[stage] == "int8" and len(devices) > 1:
            slowest_bw = min(self.cluster.device(d).spec.mem_bw_bytes_per_s for d in devices)
            return int8_allreduce_ms(params, comm.ring_links(self.cluster, devices), len(devices), slowest_bw)
        if self.allreduce_codecs[stage] == "powersgd" and len(devices) > 1:
            specs = [self.cluster.device(d).spec for d in devices]
            slowest = min(specs, key=lambda s: s.effective_flops_per_s("float32"))
            return powersgd_allreduce_ms(params, stage_param_tensors(self.chain, lo, hi),
                                         comm.ring_links(self.cluster, devices), len(devices),
                                         slowest.effective_flops_per_s("float32"), slowest.mem_bw_bytes_per_s)
        return comm.group_allreduce_ms(self.cluster, devices, params * memory.bytes_per_param(self.config).grads)

    def memory_bytes(self, rank: int, peak_in_flight: int) -> int:
        """Peak bytes of ``rank`` holding at most ``peak_in_flight`` microbatches' activations at once."""
        info = self.ranks[rank]
        verifier_state = sum(2 * round(self.boundary_bytes[b]) for b, _ in self.verified[rank])  # EMA + copy
        if info.stage is None:
            return verifier_state
        lo, hi = self.ranges[info.stage]
        br = memory.stage_memory(self.chain, lo, hi, self.config, max(peak_in_flight, 1),
                                 recompute=self.recompute[info.stage])
        acts = br.activations_bytes if peak_in_flight else 0
        feedback = ALLREDUCE_STATE_BYTES_PER_PARAM[self.allreduce_codecs[info.stage]] \
            * memory.stage_param_count(self.chain, lo, hi)  # its error-feedback buffer
        return br.static_bytes + br.buffers_bytes + acts + verifier_state + feedback

    @classmethod
    def for_plan(cls, plan: Plan) -> "CostModel":
        return cls(chain=plan.chain(), stage_ranges=tuple((s.first_block, s.last_block) for s in plan.stages),
                   ranks=plan.ranks, verifiers=plan.verifiers, cluster=plan.effective_cluster(),
                   config=plan.config, recompute=tuple(s.recompute for s in plan.stages),
                   codecs=tuple(s.out_codec for s in plan.stages),
                   allreduce_codecs=tuple(s.allreduce_codec for s in plan.stages))

    @classmethod
    def for_rehearsal(cls, plan: Plan, local: DeviceSpec, *, emulate: bool, slowdown: float = 1.0) -> "CostModel":
        """The costs of running ``plan`` on one machine whose device is ``local`` (a profile with its
        point-to-point link measured): ``stagewise run``, every rank there, talking over that link.

        ``emulate`` (``--emulate-speed``): each stage pass is padded as ``planner.runtime.rank.emulate``
        pads it, to its planned device's time over the fastest planned device's for the stage, times
        ``slowdown`` (``--emulate-slowdown``); simulate with ``emulated=True`` so the padding holds no core.
        """
        if local.p2p_bandwidth_gbps is None or local.p2p_latency_ms is None:
            raise InvalidInputError(f"device {local.name} for the rehearsal", expected="a profile with its "
                                    "point-to-point link measured", found="no p2p figures",
                                    fix="profile without --no-p2p")
        if not slowdown >= 1.0 or (slowdown != 1.0 and not emulate):
            raise InvalidInputError("rehearsal slowdown", expected="a factor >= 1 (above 1 only with emulated speeds)",
                                    found=f"{slowdown} ({'with' if emulate else 'without'} emulated speeds)")
        planned = cls.for_plan(plan)
        link = Link(bandwidth_gbps=local.p2p_bandwidth_gbps, latency_ms=local.p2p_latency_ms)
        planned_cluster = plan.effective_cluster()
        hosts = tuple(replace(h, devices=tuple(replace(d, spec=local) for d in h.devices), intra_host=None)
                      for h in planned_cluster.hosts)
        here = replace(planned_cluster, hosts=hosts, intra_host=link, default=link, regions=(), host_links=())
        costs = cls(chain=planned.chain, stage_ranges=planned.ranges, ranks=plan.ranks, verifiers=plan.verifiers,
                    cluster=here, config=plan.config, recompute=planned.recompute, codecs=planned.codecs,
                    allreduce_codecs=planned.allreduce_codecs)
        for r, info in enumerate(plan.ranks):
            if info.stage is None or not emulate:
                continue
            ref_fwd, ref_bwd = planned._local[r]
            costs._local[r] = (costs._fwd[r], costs._bwd[r])  # what this machine computes before padding
            costs._fwd[r] *= slowdown * max(1.0, planned._fwd[r] / ref_fwd) if ref_fwd > 0 else slowdown
            costs._bwd[r] *= slowdown * max(1.0, planned._bwd[r] / ref_bwd) if ref_bwd > 0 else slowdown
        return costs
