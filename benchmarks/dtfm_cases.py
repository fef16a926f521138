"""DT-FM's five simulated 64-GPU networks as Stagewise cluster files.

Source: DS3Lab/DT-FM (Yuan et al., "Decentralized Training of Foundation Models
in Heterogeneous Environments", NeurIPS 2022), file
``scheduler/heuristic_evolutionary_solver/config.py`` at commit
``cda948f02111ad194ce108d4c65b85258afd0c19``, functions ``simulate_0`` .. ``simulate_4``.
Re-expressed here (not copied): each case is a list of 64 region names plus a
(delay ms, bandwidth Gb/s) per region pair; ``matrices(case)`` rebuilds DT-FM's
64x64 matrices from that (diagonal included), ``write_cluster`` writes
``benchmarks/clusters/dtfm-<case>.yaml``.

* datacenter:   8 instances of 8 GPUs; 100 Gb/s within an instance, 3.125 across; 0 ms.
* spot:         8 spot instances of 4 GPUs (100 Gb/s inside) + 32 standalone GPUs; 1.25 Gb/s elsewhere; 0 ms.
* universities: GPUs 0-31 Ohio, 32-63 Virginia; 1 ms / 5 Gb/s inside, 11 ms / 1.12 Gb/s across.
* regional:     16 each in Virginia, Oregon, California, Ohio; 5 ms / 2 Gb/s inside, measured pairs across.
* worldwide:    8 each in 8 AWS regions; 5 ms / 2 Gb/s inside, measured AWS pairs across.

Every GPU is a V100-16GB (AWS p3 instances, as in the paper), one GPU per host
``gpu00``..``gpu63`` so that every pair of GPUs takes a network link; all hosts
trusted, one trust domain (DT-FM has no untrusted workers). A region pair whose
link is constant becomes a ``links.regions`` entry, any other pair of GPUs a
``links.hosts`` entry (none are needed for these five cases).

Run: ``python benchmarks/dtfm_cases.py`` (writes the five files, reloads each
and checks every GPU pair's link against the matrices; ``--quick``: the same into a
temporary folder, each file compared with the one in ``benchmarks/clusters/``).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from itertools import combinations
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT_DIR = ROOT / "benchmarks" / "clusters"
SOURCE = ("DS3Lab/DT-FM", "scheduler/heuristic_evolutionary_solver/config.py",
          "cda948f02111ad194ce108d4c65b85258afd0c19")
CASES = ("datacenter", "spot", "universities", "regional", "worldwide")
N_GPUS = 64
DEVICE_TYPE = "V100-16GB"

# AWS inter-region (delay ms, bandwidth Gb/s) that config.py's worldwide case uses.
_WORLD = {
    ("Oregon", "Virginia"): (67, 0.79), ("Oregon", "Ohio"): (49, 1.10), ("Oregon", "Tokyo"): (96, 0.523),
    ("Oregon", "Seoul"): (124, 0.46), ("Oregon", "London"): (136, 0.42), ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482), ("Virginia", "Ohio"): (11, 1.12), ("Virginia", "Tokyo"): (143, 0.524),
    ("Virginia", "Seoul"): (172, 0.500), ("Virginia", "London"): (76, 1.16),
    ("Virginia", "Frankfurt"): (90, 1.02), ("Virginia", "Ireland"): (67, 1.05), ("Ohio", "Tokyo"): (130, 0.694),
    ("Ohio", "Seoul"): (159, 0.529), ("Ohio", "London"): (86, 1.05), ("Ohio", "Frankfurt"): (99, 0.799),
    ("Ohio", "Ireland"): (77, 1.14), ("Tokyo", "Seoul"): (34, 1.10), ("Tokyo", "London"): (210, 0.366),
    ("Tokyo", "Frankfurt"): (223, 0.36), ("Tokyo", "Ireland"): (199, 0.465), ("Seoul", "London"): (238, 0.342),
    ("Seoul", "Frankfurt"): (235, 0.358), ("Seoul", "Ireland"): (228, 0.335), ("London", "Frankfurt"): (14, 1.14),
    ("London", "Ireland"): (12, 1.09), ("Frankfurt", "Ireland"): (24, 1.08),
}
# The regional case's own figures (its Virginia-Oregon bandwidth differs from the worldwide table's).
_REGIONAL = {
    ("Virginia", "Oregon"): (67, 1.15), ("Virginia", "California"): (59, 1.05), ("Virginia", "Ohio"): (11, 1.12),
    ("Oregon", "California"): (12, 1.25), ("Oregon", "Ohio"): (49, 1.10), ("California", "Ohio"): (52, 1.02),
}


def regions(case: str) -> list[str]:
    """The region DT-FM's config assigns to each of the 64 GPUs (its own names)."""
    if case == "datacenter":
        return [f"instance_{i // 8}" for i in range(N_GPUS)]
    if case == "spot":
        return [f"spot_instance_{i // 4}" if i < 32 else "standalone" for i in range(N_GPUS)]
    if case == "universities":
        return ["Ohio" if i < 32 else "Virginia" for i in range(N_GPUS)]
    if case == "regional":
        return [("Virginia", "Oregon", "California", "Ohio")[i // 16] for i in range(N_GPUS)]
    if case == "worldwide":
        return [("Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland")[i // 8]
                for i in range(N_GPUS)]
    raise ValueError(f"unknown case {case!r}; expected one of {', '.join(CASES)}")


def region_link(case: str, a: str, b: str) -> tuple[float, float]:
    """(delay ms, bandwidth Gb/s) between a GPU in region ``a`` and one in ``b`` (a may equal b)."""
    same = a == b
    if case == "datacenter":
        return (0.0, 100.0) if same else (0.0, 3.125)
    if case == "spot":
        return (0.0, 100.0) if same and a != "standalone" else (0.0, 1.25)
    if case == "universities":
        return (1.0, 5.0) if same else (11.0, 1.12)
    table = _REGIONAL if case == "regional" else _WORLD
    if same:
        return (5.0, 2.0)
    delay, bw = table.get((a, b)) or table[(b, a)]
    return float(delay), float(bw)


def matrices(case: str) -> tuple[np.ndarray, np.ndarray]:
    """DT-FM's (delay ms, bandwidth Gb/s) 64x64 matrices for ``case``, diagonal as its config builds it."""
    reg = regions(case)
    delay, bw = np.empty((N_GPUS, N_GPUS)), np.empty((N_GPUS, N_GPUS))
    for i in range(N_GPUS):
        for j in range(N_GPUS):
            delay[i, j], bw[i, j] = region_link(case, reg[i], reg[j])
    return delay, bw


def host_name(i: int) -> str:
    return f"gpu{i:02d}"


def _link(bw: float, delay: float) -> str:
    return f"bandwidth_gbps: {float(bw)!r}, latency_ms: {float(delay)!r}"


def cluster_yaml(case: str) -> tuple[str, int, int]:
    """The cluster file's text, with its number of region-pair and host-pair link entries."""
    reg = regions(case)
    delay, bw = matrices(case)
    members: dict[str, list[int]] = {}
    for i, r in enumerate(reg):
        members.setdefault(r, []).append(i)
    names = list(members)
    region_lines, host_lines = [], []
    for ai, a in enumerate(names):
        for b in names[ai:]:
            pairs = [(i, j) for i in members[a] for j in members[b] if i < j] if a == b else \
                [(i, j) for i in members[a] for j in members[b]]
            values = {(bw[i, j], delay[i, j]) for i, j in pairs}
            if len(values) == 1:
                region_lines.append(f"    - {{between: [{a}, {b}], {_link(*values.pop())}}}")
            else:  # not constant within the region pair: one entry per GPU pair
                host_lines += [f"    - {{between: [{host_name(i)}, {host_name(j)}], {_link(bw[i, j], delay[i, j])}}}"
                               for i, j in pairs]
    off_diag = Counter((bw[i, j], delay[i, j]) for i, j in combinations(range(N_GPUS), 2))
    default = off_diag.most_common(1)[0][0]
    repo, path, commit = SOURCE
    out = [f"# DT-FM network case '{case}': 64 GPUs, pairwise delay (ms) and bandwidth (Gb/s) as built by",
           f"# {repo} {path} (commit {commit}).",
           "# Generated by benchmarks/dtfm_cases.py; do not edit. One V100 per host (intra_host unused);",
           "# every region pair is listed, so `default` (the most common value) is never reached.",
           f"name: dtfm-{case}", "hosts:"]
    for i, r in enumerate(reg):
        out.append(f"  - {{name: {host_name(i)}, region: {r}, trust: dtfm, trusted: true, "
                   f"devices: [{{type: {DEVICE_TYPE}, count: 1}}]}}")
    out += ["links:", f"  default: {{{_link(*default)}}}", "  regions:", *region_lines]
    if host_lines:
        out += ["  hosts:", *host_lines]
    return "\n".join(out) + "\n", len(region_lines), len(host_lines)


def check_cluster(path: Path, case: str) -> float:
    """Load ``path`` and compare every GPU pair's link with the matrices; return the load time in s."""
    from cost_models import load_cluster

    t0 = time.perf_counter()
    cluster = load_cluster(path)
    load_s = time.perf_counter() - t0
    delay, bw = matrices(case)
    ids = [d.id for d in cluster.stage_devices]
    assert ids == [f"{host_name(i)}/0" for i in range(N_GPUS)], ids[:3]
    for i, j in combinations(range(N_GPUS), 2):
        link = cluster.link(ids[i], ids[j])
        assert (link.latency_ms, link.bandwidth_gbps) == (delay[i, j], bw[i, j]), (case, i, j, link)
    return load_s


def write_all(out_dir: Path) -> None:
    """Write and check every case's file in ``out_dir``; say whether it equals the one in ``OUT_DIR``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        text, n_regions, n_hosts = cluster_yaml(case)
        path = out_dir / f"dtfm-{case}.yaml"
        path.write_text(text)
        load_s = check_cluster(path, case)
        kept = OUT_DIR / path.name
        same = "" if out_dir == OUT_DIR else \
            f"; {'same as' if kept.is_file() and kept.read_text() == text else 'DIFFERS from'} {kept.relative_to(ROOT)}"
        print(f"{path.name}: {n_regions} region-pair and {n_hosts} host-pair links; "
              f"load_cluster {load_s * 1e3:.1f} ms; all {N_GPUS * (N_GPUS - 1) // 2} pairs match{same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="write into a temporary folder, not benchmarks/clusters/")
    args = ap.parse_args()
    if not args.quick:
        write_all(OUT_DIR)
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_all(Path(tmp))


if __name__ == "__main__":
    main()
