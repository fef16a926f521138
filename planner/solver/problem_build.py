"""A :class:`planner.solver.problem.Problem` built from a BlockChain, a ClusterSpec and the cost models: the
chain scaled to a microbatch size, the devices grouped into classes, the links between classes, the cost tables."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from cost_models import codecs, compute, memory, optim, verify
from cost_models.cluster import ClusterSpec, Device, Link
from cost_models.devices import DeviceSpec
from cost_models.training import OPTIM_OPS_PER_TENSOR, TrainingConfig
from planner.errors import InvalidInputError
from planner.ir import Block, BlockChain, dtype_bytes
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import DeviceClass, Problem, TiedCopy


def _verify_coefficients(spec: DeviceSpec) -> tuple[float, float]:
    """(fixed ms, ms per byte) of ``cost_models.verify.verify_ms``, which is linear in the bytes."""
    fixed = verify.verify_ms(0, spec)
    return fixed, (verify.verify_ms(1e9, spec) - fixed) / 1e9


def scale_chain(chain: BlockChain, microbatch_size: int) -> BlockChain:
    """The chain's per-microbatch figures at another microbatch size.

    FLOPs, saved activations, boundary bytes and input bytes scale linearly
    with the batch; memory traffic scales except for the weights, which every
    microbatch reads once whatever its size.
    """
    if microbatch_size < 1:
        raise InvalidInputError("microbatch size", expected=">= 1", found=str(microbatch_size))
    if microbatch_size == chain.microbatch_size:
        return chain
    f = microbatch_size / chain.microbatch_size

    def scaled(b: Block) -> Block:
        act_traffic = max(0, b.mem_traffic_bytes - b.param_bytes)
        return dataclasses.replace(
            b, fwd_flops=round(b.fwd_flops * f), bwd_flops=round(b.bwd_flops * f),
            bwd_input_flops=None if b.bwd_input_flops is None else round(b.bwd_input_flops * f),
            saved_act_bytes=round(b.saved_act_bytes * f), out_bytes=round(b.out_bytes * f),
            mem_traffic_bytes=round(min(b.mem_traffic_bytes, b.param_bytes) + act_traffic * f))

    return dataclasses.replace(chain, blocks=tuple(scaled(b) for b in chain.blocks),
                               input_bytes=round(chain.input_bytes * f), microbatch_size=microbatch_size)


def _domains_that_matter(devices: Sequence[Device]) -> set[str]:
    trusted = {d.trust for d in devices if d.trusted}
    return {d.trust for d in devices if not d.trusted} & trusted


def _class_key(dev: Device, cluster: ClusterSpec, single: bool, mixed: set[str]) -> tuple:
    host = cluster.host(dev.host)
    overridden = any(dev.host in hl.between for hl in cluster.host_links)
    domain = dev.trust if dev.trust in mixed else None
    # One-device hosts that differ only in name are interchangeable; anything else is per host.
    where = ("region", dev.region) if single and not overridden else ("host", dev.host)
    return (where, dev.spec, dev.trusted, domain, host.role)


def device_classes(cluster: ClusterSpec, config: TrainingConfig) -> tuple[DeviceClass, ...]:
    """Group the cluster's devices into classes of interchangeable devices, in cluster order."""
    devices = cluster.devices
    mixed = _domains_that_matter(devices)
    groups: dict[tuple, list[Device]] = {}
    for dev in devices:
        single = len(cluster.host(dev.host).devices) == 1
        groups.setdefault(_class_key(dev, cluster, single, mixed), []).append(dev)
    out = []
    for i, (key, devs) in enumerate(groups.items()):
        first = devs[0]
        host = cluster.host(first.host)
        where = key[0][1] if key[0][0] == "host" else f"{key[0][1]}x{len(devs)}"
        out.append(DeviceClass(
            index=i, name=f"{first.spec.name}@{where}", device_ids=tuple(d.id for d in devs), spec=first.spec,
            trusted=first.trusted, domain=key[3], stage_capable=host.role == "worker",
            verifier_host=host.role == "verifier" and first.trusted,
            mem_bytes=memory.usable_memory_bytes(first.spec),
            verify_ms_per_byte=_verify_coefficients(first.spec)[1],
            verify_fixed_ms=_verify_coefficients(first.spec)[0]))
    return tuple(out)


def class_links(cluster: ClusterSpec, classes: Sequence[DeviceClass]) -> tuple[tuple[Link | None, ...], ...]:
    """Links between two distinct devices of each class pair (None: a one-device class with itself)."""
    rows = []
    for a in classes:
        row = []
        for b in classes:
            if a.index == b.index:
                row.append(cluster.link(a.device_ids[0], a.device_ids[1]) if a.count > 1 else None)
            else:
                row.append(cluster.link(a.device_ids[0], b.device_ids[0]))
        rows.append(tuple(row))
    return tuple(rows)


def build_problem(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                  policy: VerificationPolicy, *, max_replicas: int | None = None) -> Problem:
    """Cost tables for ``chain`` on ``cluster`` at ``config``'s microbatch count.

    Block times come from ``cost_models.compute`` at the chain's traced
    microbatch size (scale the chain first with :func:`scale_chain`);
    activation and boundary bytes are scaled to ``config`` exactly as
    ``cost_models.memory`` scales them.
    """
    classes = device_classes(cluster, config)
    traced = memory.trace_dtype(chain)
    passes = np.array([compute.block_times_ms(chain, c.spec, config.dtype, trace_dtype=traced) for c in classes],
                      dtype=float).reshape(len(classes), len(chain.blocks), 2)
    times = (passes[:, :, 0] + passes[:, :, 1]).T.copy()
    batch_scale = config.microbatch_size / chain.microbatch_size
    act_scale = memory.activation_scale(chain, config)  # what the memory model and the simulator use
    out = np.array([b.out_bytes * act_scale for b in chain.blocks], dtype=float)
    elem = dtype_bytes(traced)
    tied = tuple(TiedCopy(first_block=min(t.blocks), readers=tuple(sorted(set(t.blocks) - {min(t.blocks)})),
                          param_count=t.nbytes // elem) for t in chain.tied_params if len(set(t.blocks)) > 1)
    per = memory.bytes_per_param(config)
    return Problem(
        name=chain.model_name, block_names=tuple(b.name for b in chain.blocks), time_ms=times,
        param_count=np.array([b.param_count for b in chain.blocks], dtype=np.int64),
        act_bytes=np.array([math.ceil(b.saved_act_bytes * act_scale) for b in chain.blocks], dtype=np.int64),
        out_bytes=out, out_bytes_int=np.ceil(out).astype(np.int64),
        input_bytes=math.ceil(chain.input_bytes * batch_scale), tied=tied,
        state_bytes_per_param=per.total, grad_bytes_per_param=per.grads, classes=classes,
        links=class_links(cluster, classes), num_microbatches=config.num_microbatches,
        schedule=config.schedule, policy=policy, max_replicas=max_replicas, bwd_ms=passes[:, :, 1].T.copy(),
        optim_traffic_per_param=optim.traffic_bytes_per_param(config),
        optim_kernels_per_tensor=OPTIM_OPS_PER_TENSOR.get(config.optimizer, 1),
        param_tensors=np.array([len(b.param_names) for b in chain.blocks], dtype=np.int64),
        codec=search_codec(config.compress), elem_bytes=dtype_bytes(config.dtype), compress=config.compress,
        search_grad_bytes_per_param=_powersgd_bytes_per_param(chain) if config.compress == "auto" else None,
        random_ops=tuple(b.random_ops for b in chain.blocks),
        bwd_split=tuple((b.bwd_flops, b.bwd_input_flops) for b in chain.blocks))


def _powersgd_bytes_per_param(chain: BlockChain) -> float:
    """The whole model's PowerSGD bytes per parameter (``cost_models.codecs.powersgd_bytes``)."""
    params = sum(b.param_count for b in chain.blocks)
    tensors = sum(len(b.param_names) for b in chain.blocks)
    return codecs.powersgd_bytes(params, tensors) / params if params else 0.0


def search_codec(compress: str) -> str:
    """The boundary codec the searches assume for ``--compress``: ``auto`` plans as if every boundary were
    int8 (the cheapest it chooses from), then each stage keeps the least lossy codec that prices as well."""
    return "int8" if compress == "auto" else compress
