"""Encode/decode time of the boundary codecs (``planner.runtime.wire.codecs``) on this CPU, one thread, against
their price (``cost_models.codecs.codec_ms`` for a CPU of the profiled ``op_overhead_ms`` and memory bandwidth).

Per codec, direction and size (fp32 values): the fastest of ``--repeats`` timings of one encode and one decode
(the fastest: other processes on a shared machine only ever add time), the fixed cost per call and the cost per
byte fitted by least squares over the sizes, and the price. Prints a table; writes nothing.

Run: ``python benchmarks/codec_timing.py [--profile tests/fixtures/profile_cpu.json] [--repeats 15]``
(about a minute); ``--quick``: two sizes, one repeat.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cost_models.codecs import codec_ms
from planner.runtime.wire.codecs import decode, encode

ROOT = Path(__file__).resolve().parents[1]
SIZES = (4096, 16384, 65536, 262144, 1 << 20)
CASES = (("fp8", "F"), ("fp8", "B"), ("int8", "F"), ("int8", "B"), ("int4", "F"), ("int4", "B"))


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` weighted by 1/y (relative errors count alike at every size)."""
    w = [1.0 / y ** 2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT / "tests" / "fixtures" / "profile_cpu.json"))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="two sizes, one repeat")
    args = ap.parse_args()
    sizes, repeats = ((4096, 16384), 1) if args.quick else (SIZES, args.repeats)
    torch.set_num_threads(1)
    spec = json.loads(Path(args.profile).read_text())["device"]
    bw, ovh = spec["mem_bw_bytes_per_s"], spec["op_overhead_ms"]
    print(f"profile: op_overhead_ms {ovh:.4f}, mem_bw {bw / 1e9:.1f} GB/s")
    print("| codec | dir | op | values | measured ms | priced ms | ratio |\n|---|---|---|---|---|---|---|")
    fits = []
    for codec, d in CASES:
        for op in ("encode", "decode"):
            ms = []
            for n in sizes:
                x = torch.randn(n)
                payload = encode(x, codec, d)
                fn = (lambda x=x, c=codec, d=d: encode(x, c, d)) if op == "encode" else \
                    (lambda x=x, p=payload, c=codec, d=d: decode(p, c, x.shape, x.dtype, d))
                ms.append(_best_ms(fn, repeats))
                priced = codec_ms(codec, 4.0 * n, bw, op, op_overhead_ms=ovh, kind="cpu", direction=d)
                print(f"| {codec} | {d} | {op} | {n} | {ms[-1]:.3f} | {priced:.3f} | {ms[-1] / priced:.2f} |")
            a, b = _fit([4.0 * n for n in sizes], ms)
            fits.append((codec, d, op, a, b))
    print("\n| codec | dir | op | fixed ms | fixed / op_overhead | ns per byte | passes at mem_bw |\n"
          "|---|---|---|---|---|---|---|")
    for codec, d, op, a, b in fits:
        print(f"| {codec} | {d} | {op} | {a:.4f} | {a / ovh:.1f} | {1e6 * b:.3f} | {b * 1e-3 * bw / 2:.1f} |")


if __name__ == "__main__":
    main()
