"""``stagewise export-onnx MODEL -o FILE.onnx``: export a model with its weights as external data."""
from __future__ import annotations

import argparse
from pathlib import Path

from planner.errors import InvalidInputError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export-onnx", help="export a model to ONNX (weights as external data)",
        description="Build MODEL with real (CPU) weights and export it with torch.onnx (dynamo) to FILE.onnx, "
                    "weights in FILE.onnx.data. The file is written atomically.")
    p.add_argument("model", metavar="MODEL", help="preset name or package.module:factory")
    p.add_argument("-o", "--output", required=True, metavar="FILE.onnx", help="where to write the model")
    p.add_argument("--batch", type=int, default=1, help="batch size fixed in the exported graph (default 1)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (LMs) or image side (CNNs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic weight init")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from planner.model_io import is_onnx_spec

    out = Path(args.output)
    if out.suffix.lower() != ".onnx":
        raise InvalidInputError(f"output {args.output!r}", expected="a path ending in .onnx", found=repr(out.suffix),
                                fix=f"use -o {out.with_suffix('.onnx')}")
    if is_onnx_spec(args.model):
        raise InvalidInputError(f"model {args.model!r}", expected="a preset or package.module:factory",
                                found="already an ONNX file", fix="copy the file instead")
    from models.registry import build_model
    from planner.onnx_import import export_onnx

    bundle = build_model(args.model, batch=args.batch, seq=args.seq, device="cpu", seed=args.seed)
    export_onnx(bundle.module, bundle.example_inputs, out)
    params = sum(p.numel() for p in bundle.module.parameters())
    print(f"wrote {out} and {out.name}.data ({params:,} parameters, inputs "
          f"{', '.join(str(list(t.shape)) for t in bundle.example_inputs)})")
    return 0
