"""``stagewise export-onnx MODEL -o FILE.onnx``: export a model with its weights as external data."""
from __future__ import annotations

import argparse
from pathlib import Path

from models.registry import build_model
from planner.commands._common import add_model_argument, add_shape_arguments
from planner.errors import InvalidInputError
from planner.model_io import is_onnx_spec
from planner.onnx_import import export_onnx
from planner.outputs import check_writable


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export-onnx", help="export a model to ONNX (weights as external data)",
        description="Build MODEL with real (CPU) weights and export it with torch.onnx (dynamo) to FILE.onnx, "
                    "weights in FILE.onnx.data. The file is written atomically.")
    add_model_argument(p, onnx=False)
    p.add_argument("-o", "--output", required=True, metavar="FILE.onnx", help="where to write the model")
    add_shape_arguments(p, batch_default=1, batch_help="batch size fixed in the exported graph (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic weight init")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:

    out = Path(args.output)
    if out.suffix.lower() != ".onnx":
        raise InvalidInputError(f"output {args.output!r}", expected="a path ending in .onnx", found=repr(out.suffix),
                                fix=f"use -o {out.with_suffix('.onnx')}")
    if is_onnx_spec(args.model):
        raise InvalidInputError(f"model {args.model!r}", expected="a preset or package.module:factory",
                                found="already an ONNX file", fix="copy the file instead")
    check_writable(out, what="-o")
    check_writable(out.with_name(out.name + ".data"), what="the weights file beside -o")

    bundle = build_model(args.model, batch=args.batch, seq=args.seq, device="cpu", seed=args.seed)
    export_onnx(bundle.module, bundle.example_inputs, out)
    params = sum(p.numel() for p in bundle.module.parameters())
    print(f"wrote {out} and {out.name}.data ({params:,} parameters, inputs "
          f"{', '.join(str(list(t.shape)) for t in bundle.example_inputs)})")
    return 0
