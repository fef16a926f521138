"""Random block chains and clusters for the solver tests and benchmark (seeded, GPT-like magnitudes)."""
from __future__ import annotations

import numpy as np

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import parse_cluster
from planner.ir import Block, BlockChain, TiedParam

GPU_TYPES = ("A100-80GB", "RTX3090", "T4", "V100-16GB", "A100-40GB", "L4")


def random_chain(rng: np.random.Generator, num_blocks: int, *, name: str = "rand", param_scale: float = 2e8,
                 flop_scale: float = 5e11, act_scale: float = 2e8, out_scale: float = 2e7,
                 uniform: bool = False, tie: bool = False) -> BlockChain:
    """A chain whose blocks vary around the given scales (``uniform``: identical transformer-like blocks)."""
    blocks = []
    for l in range(num_blocks):
        f = 1.0 if uniform else float(rng.uniform(0.3, 1.7))
        params = int(param_scale * (1.0 if uniform else rng.uniform(0.0, 2.0)))
        fwd = int(flop_scale * f)
        out = int(out_scale * (1.0 if uniform else rng.uniform(0.2, 2.0)))
        blocks.append(Block(index=l, name=f"layers.{l}", node_names=(f"n{l}",), module_paths=(f"layers.{l}",),
                            param_names=(f"p{l}",), fwd_flops=fwd, bwd_flops=2 * fwd, param_count=params,
                            param_bytes=4 * params, saved_act_bytes=int(act_scale * f), out_bytes=out,
                            boundary_nodes=(f"n{l}",), mem_traffic_bytes=4 * params + 3 * out))
    return BlockChain(model_name=name, fingerprint=f"{name}-{num_blocks}", blocks=tuple(blocks),
                      input_bytes=int(out_scale / 100), microbatch_size=1, tied_params=tied_params(blocks, tie))


def tied_params(blocks: list[Block], tie: bool) -> tuple[TiedParam, ...]:
    """Tie the first block's parameters to the last block (an embedding reused by the LM head)."""
    if not tie or len(blocks) < 2:
        return ()
    return (TiedParam(name="p0", blocks=(0, len(blocks) - 1), nbytes=blocks[0].param_bytes),)


def random_cluster(rng: np.random.Generator, num_devices: int, *, types: int = 3, untrusted: bool = True,
                   verifier_host: bool = False, single_device_hosts: bool = True,
                   mixed_domains: bool = False) -> ClusterSpec:
    """Hosts of random GPU types over two regions; trusted operator hosts plus untrusted volunteers.

    ``mixed_domains``: some untrusted hosts sit in the operator's trust domain (their boundaries
    need a verifier outside it), so trust-domain rules bind.
    """
    kinds = list(rng.choice(GPU_TYPES, size=types, replace=False))
    hosts, left, i = [], num_devices, 0
    while left > 0:
        n = 1 if single_device_hosts and rng.random() < 0.6 else int(min(left, rng.integers(1, 3)))
        trusted = (i == 0) or not untrusted or rng.random() < 0.4
        hosts.append({"name": f"h{i}", "region": str(rng.choice(["us", "eu"])),
                      "trust": "operator" if trusted or (mixed_domains and rng.random() < 0.5) else f"vol{i}",
                      "trusted": bool(trusted),
                      "devices": [{"type": str(rng.choice(kinds)), "count": n}]})
        left -= n
        i += 1
    if verifier_host:
        trust = "audit" if mixed_domains and rng.random() < 0.5 else "operator"
        hosts.append({"name": "verifier", "region": "eu", "trust": trust, "trusted": True,
                      "role": "verifier", "devices": [{"type": "CPU", "count": 1}]})
    links = {"intra_host": {"bandwidth_gbps": float(rng.choice([128, 2400])), "latency_ms": 0.01},
             "default": {"bandwidth_gbps": float(rng.choice([10, 100])), "latency_ms": 0.5}}
    if {h["region"] for h in hosts} >= {"us", "eu"}:
        links["regions"] = [{"between": ["us", "eu"], "bandwidth_gbps": float(rng.choice([0.5, 2.0])),
                             "latency_ms": 40.0}]
    return parse_cluster({"name": "rand", "hosts": hosts, "links": links})


def tiered_cluster(num_devices: int, *, types: tuple[str, ...] = ("A100-80GB", "V100-16GB", "RTX3090", "T4"),
                   host_size: int = 8, verifier_host: bool = True) -> ClusterSpec:
    """A benchmark cluster: trusted multi-GPU data-centre hosts of the first types, untrusted one-GPU
    volunteers of the last ones, two regions, and a CPU verifier host."""
    hosts = []
    dc_types = types[:max(1, len(types) // 2)]
    vol_types = types[len(dc_types):] or types
    dc_devices = max(2, num_devices // 4)
    n, i = 0, 0
    while n < dc_devices:
        count = min(host_size, dc_devices - n)
        hosts.append({"name": f"dc{i}", "region": "us", "trust": "operator", "trusted": True,
                      "devices": [{"type": dc_types[i % len(dc_types)], "count": count}]})
        n += count
        i += 1
    for v in range(num_devices - n):
        hosts.append({"name": f"vol{v}", "region": "us" if v % 2 else "eu", "trust": f"vol{v}",
                      "trusted": False, "devices": [{"type": vol_types[v % len(vol_types)], "count": 1}]})
    if verifier_host:
        hosts.append({"name": "verifier", "region": "us", "trust": "operator", "trusted": True,
                      "role": "verifier", "devices": [{"type": "CPU", "count": 1}]})
    links = {"intra_host": {"bandwidth_gbps": 2400, "latency_ms": 0.005},
             "default": {"bandwidth_gbps": 25, "latency_ms": 0.5},
             "regions": [{"between": ["us", "eu"], "bandwidth_gbps": 1.0, "latency_ms": 40.0}]}
    return parse_cluster({"name": f"tiered-{num_devices}", "hosts": hosts, "links": links})


def homogeneous_cluster(num_devices: int, *, gpu: str = "A100-80GB", host_size: int = 8) -> ClusterSpec:
    hosts, n, i = [], 0, 0
    while n < num_devices:
        count = min(host_size, num_devices - n)
        hosts.append({"name": f"node{i}", "region": "dc", "trust": "operator", "trusted": True,
                      "devices": [{"type": gpu, "count": count}]})
        n += count
        i += 1
    links = {"intra_host": {"bandwidth_gbps": 200, "latency_ms": 0.01},
             "default": {"bandwidth_gbps": 200, "latency_ms": 0.01}}
    return parse_cluster({"name": f"homog-{num_devices}", "hosts": hosts, "links": links})
