"""The integrity monitors on compressed boundaries: clean runs, a bias hidden in the quantization noise, the suite.

The single-process emulation of ``benchmarks/verification.py`` / ``verification_clean.py`` (gpt-tiny, 4 stages,
the runtime's ``Verifier.check`` / ``flag_events`` / ``end_step`` calls), every boundary tensor encoded and
decoded with its codec (``planner.runtime.wire.codecs``, as ``executor_p2p`` does) after the sender's attack:
consumers and verifiers both get the decoded tensor, as in the runtime (``_decoded`` / ``_delivered``).

Sections:

- ``clean``: the clean shapes of ``verification_clean`` (one-verifier, split, replicated) with each codec:
  microbatch and step flags, blamed pairs, bans.
- ``quant_bias``: rank 1 adds a fixed-direction bias of ``frac`` times the codec's quantization step
  (``attacks`` kind ``quant_bias``) to what it sends, on activations and on gradients: the step it is
  banned at (None: never) and the validation loss against the clean run's (damage, nats).
- ``suite``: the detection suite's attacks on a compressed plan: ban latency in steps.

    python benchmarks/verification_codecs.py            # writes benchmarks/results/verification_codecs.json
    python benchmarks/verification_codecs.py --quick    # a smoke run of each section, nothing written
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.verification import ATTACKS, Pipeline, RunConfig, _write, run
from benchmarks.verification_clean import SHAPES, ShapedPipeline
from planner.runtime.wire import codecs as wire

CODECS = ("none", "fp8", "int8", "int4")
WIRE_DIRECTION = {"act": "F", "grad": "B"}
RESULTS = ROOT / "benchmarks" / "results" / "verification_codecs.json"
SUITE = ("constant", "zeros", "random", "scale-1", "grad-sign-flip", "random-sign", "delay", "bias", "noise",
         "noise-grad", "adaptive")
FULL = {"clean_steps": 120, "seeds": (0, 1), "attack_seeds": (0,), "attack_steps": 40, "start": 12,
        "suite_codecs": ("fp8", "int8", "int4"), "fracs": (0.5, 0.9)}
QUICK = {"clean_steps": 12, "seeds": (0,), "attack_seeds": (0,), "attack_steps": 14, "start": 6, "suite_codecs": ("int8",),
         "fracs": (0.9,)}


def wired(x: torch.Tensor, codec: str, direction: str) -> torch.Tensor:
    """What the receiver of ``x`` computes on under ``codec``: encoded and decoded, as on the wire."""
    d = WIRE_DIRECTION[direction]
    return wire.decode(wire.encode(x, codec, d), codec, x.shape, x.dtype, d)


class _Wired:
    """Mixed in before a pipeline: every sent tensor crosses its boundary encoded under ``codec``."""

    codec = "none"

    def set_codec(self, codec: str) -> None:
        """Every boundary under ``codec``, and the verifiers told (as ``VerifyHooks`` tells them the plan's)."""
        self.codec = codec
        for verifier in getattr(self, "verifiers", [self.verifier]):   # type: ignore[attr-defined]
            for mon in ([] if verifier is None else verifier._monitors.values()):
                mon.codec = codec

    def _send(self, x: torch.Tensor, rank: int, direction: str, step: int, mb: int,
              stage_input: torch.Tensor | None) -> torch.Tensor:
        sent = super()._send(x, rank, direction, step, mb, stage_input)  # type: ignore[misc]
        return sent if self.codec == "none" else wired(sent, self.codec, direction)


class WiredPipeline(_Wired, Pipeline):
    pass


class WiredShapedPipeline(_Wired, ShapedPipeline):
    pass


def clean_rows(codec: str, shape: str, *, steps: int, seed: int) -> dict[str, Any]:
    built: list[WiredShapedPipeline] = []

    def factory(cfg: RunConfig) -> WiredShapedPipeline:
        pipe = WiredShapedPipeline(cfg, shape)
        pipe.set_codec(codec)
        built.append(pipe)
        return pipe

    t0 = time.perf_counter()
    result = run(RunConfig(steps=steps, seed=seed), pipeline=factory)
    pipe = built[0]
    c = pipe.counts
    return {"codec": codec, "shape": shape, "seed": seed, "steps": steps, **c,
            "fpr_per_sample": round(c["flags_microbatch"] / max(1, c["checks"]), 6),
            "flag_reasons": dict(sorted(pipe.reasons.items())), "banned": result.banned,
            "val_loss": round(result.val_loss, 4), "duration_s": round(time.perf_counter() - t0, 1)}


def attacked(codec: str, attack: str | None, *, steps: int, start: int, seed: int, verify: bool = True
             ) -> dict[str, Any]:
    def factory(cfg: RunConfig) -> WiredPipeline:
        pipe = WiredPipeline(cfg)
        pipe.set_codec(codec)
        return pipe

    r = run(RunConfig(steps=steps, start=start, seed=seed, attack=attack, verify=verify), pipeline=factory)
    blamed = sorted(s for s, who in r.blamed.items() if 1 in who)
    return {"ban_step": r.ban_step, "ban_latency_steps": None if r.ban_step is None else r.ban_step - start,
            "first_blamed_latency": next((s - start for s in blamed if s >= start), None),
            "blamed_before_start": [s for s in blamed if s < start], "banned": r.banned,
            "val_loss": round(r.val_loss, 4), "attacked_microbatches": len(r.attacked_steps)}


def quant_bias(codecs: tuple[str, ...], fracs: tuple[float, ...], *, steps: int, start: int,
               seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for codec in codecs:
        for seed in seeds:
            clean = attacked(codec, None, steps=steps, start=start, seed=seed, verify=False)["val_loss"]
            for frac in fracs:
                for direction in ("act", "grad"):
                    spec = f"kind=quant_bias,codec={codec},frac={frac},dir={direction}"
                    seen = attacked(codec, spec, steps=steps, start=start, seed=seed)
                    blind = attacked(codec, spec, steps=steps, start=start, seed=seed, verify=False)
                    rows.append({"codec": codec, "frac": frac, "dir": direction, "seed": seed, "steps": steps,
                                 "start": start, **seen, "val_loss_clean": clean,
                                 "val_loss_unverified": blind["val_loss"],
                                 "damage_nats": round(blind["val_loss"] - clean, 4)})
                    print(f"  quant_bias {codec} frac={frac} {direction} seed {seed}: ban "
                          f"{seen['ban_latency_steps']}, damage {rows[-1]['damage_nats']:+.4f}", file=sys.stderr,
                          flush=True)
    return rows


def suite(codecs: tuple[str, ...], attacks: tuple[str, ...], *, steps: int, start: int, seed: int
          ) -> list[dict[str, Any]]:
    rows = []
    for codec in codecs:
        for name in attacks:
            row = {"codec": codec, "attack": name, "seed": seed,
                   **attacked(codec, ATTACKS[name], steps=steps, start=start, seed=seed)}
            rows.append(row)
            print(f"  suite {codec} {name}: ban {row['ban_latency_steps']}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of each section, nothing written")
    parser.add_argument("--only", nargs="+", choices=("clean", "quant_bias", "suite"),
                        default=["clean", "quant_bias", "suite"])
    parser.add_argument("--out", default=None, help="merge the sections into this JSON (default: the results file; "
                                                   "none with --quick)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    knobs = QUICK if args.quick else FULL
    out = Path(args.out) if args.out else (None if args.quick else RESULTS)
    report: dict[str, Any] = {}
    if "clean" in args.only:
        report["clean"] = []
        for codec in CODECS:
            for shape in SHAPES:
                for seed in knobs["seeds"]:
                    row = clean_rows(codec, shape, steps=knobs["clean_steps"], seed=seed)
                    report["clean"].append(row)
                    print(f"clean {codec} {shape} seed {seed}: {row['checks']} checks, {row['flags_microbatch']} "
                          f"microbatch flags ({100 * row['fpr_per_sample']:.2f}%), {row['flags_step']} step flags, "
                          f"{row['blamed_pairs']} blamed pairs, banned {row['banned']} {row['flag_reasons']}",
                          flush=True)
    if "quant_bias" in args.only:
        report["quant_bias"] = quant_bias(CODECS[1:], knobs["fracs"], steps=knobs["attack_steps"],
                                          start=knobs["start"], seeds=knobs["attack_seeds"])
    if "suite" in args.only:
        report["suite"] = suite(knobs["suite_codecs"], SUITE if not args.quick else ("zeros", "grad-sign-flip"),
                                steps=knobs["attack_steps"], start=knobs["start"], seed=0)
    if out is not None:
        old = json.loads(out.read_text()) if out.exists() else {}
        old.update(report)
        old["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__}
        _write(old, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
