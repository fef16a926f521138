"""``stagewise export-onnx``: a model to one ONNX file, or a plan's stages to one ONNX file each.

``export-onnx MODEL -o FILE.onnx`` exports a model with its weights as external data.
``export-onnx --plan PLAN -o DIR`` writes ``DIR/stage{k}.onnx`` per stage of the plan, the tensors
crossing each cut as graph inputs and outputs, and ``DIR/stages.json`` saying which stage feeds which
(:mod:`planner.onnx_stages`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from models.registry import build_model
from planner.commands._common import BUILDABLE_MODEL_HELP, SEQ_HELP
from planner.errors import InvalidInputError
from planner.model_io import is_onnx_spec
from planner.outputs import check_writable
from planner.plan_load import load_plan
from planner.runtime.options import check_model_allowed

_BATCH_DEFAULT = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export-onnx", help="export a model to ONNX (weights as external data), or a plan's stages",
        usage="stagewise export-onnx MODEL -o FILE.onnx [--batch B] [--seq T] [--seed S]\n"
              "       stagewise export-onnx --plan PLAN -o DIR [--model MODULE:FN] [--seed S]",
        description="Build MODEL with real (CPU) weights and export it with torch.onnx (dynamo) to FILE.onnx, "
                    "weights in FILE.onnx.data. With --plan, write one ONNX file per stage of PLAN into DIR "
                    "(the tensors crossing each cut as graph inputs and outputs, a manifest stages.json). "
                    "Files are written atomically.")
    p.add_argument("model", nargs="?", metavar="MODEL", help=BUILDABLE_MODEL_HELP)
    p.add_argument("--plan", metavar="PLAN", help="a plan (made from an .onnx file or a torch model): export its "
                                                  "stages instead of a whole model")
    p.add_argument("-o", "--output", required=True, metavar="FILE.onnx|DIR",
                   help="the model file, or with --plan the folder of stage files")
    p.add_argument("--batch", type=int, default=None,
                   help=f"batch size fixed in the exported graph (default {_BATCH_DEFAULT}; --plan: the plan's)")
    p.add_argument("--seq", type=int, default=None, help=SEQ_HELP + " (--plan: the plan's)")
    p.add_argument("--model", dest="factory", metavar="MODULE:FN",
                   help="with --plan: allow importing the plan's package.module:factory (a plan file alone "
                        "never makes stagewise import code)")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic weight init")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.plan is not None:
        return _run_plan(args)
    if args.model is None:
        raise InvalidInputError("export-onnx", expected="MODEL -o FILE.onnx, or --plan PLAN -o DIR",
                                found="neither MODEL nor --plan", fix="name the model to export")
    if args.factory is not None:
        raise InvalidInputError("--model", expected="only with --plan", found=f"--model {args.factory}",
                                fix=f"name the model as MODEL: stagewise export-onnx {args.factory} -o FILE.onnx")
    out = Path(args.output)
    if out.suffix.lower() != ".onnx":
        raise InvalidInputError(f"output {args.output!r}", expected="a path ending in .onnx", found=repr(out.suffix),
                                fix=f"use -o {out.with_suffix('.onnx')}")
    if is_onnx_spec(args.model):
        raise InvalidInputError(f"model {args.model!r}", expected="a preset or package.module:factory",
                                found="already an ONNX file", fix="copy the file instead")
    check_writable(out, what="-o")
    check_writable(out.with_name(out.name + ".data"), what="the weights file beside -o")

    # onnx takes ~0.8 s to import: only this command needs it.
    from planner.onnx_import import export_onnx

    batch = _BATCH_DEFAULT if args.batch is None else args.batch
    bundle = build_model(args.model, batch=batch, seq=args.seq, device="cpu", seed=args.seed)
    export_onnx(bundle.module, bundle.example_inputs, out)
    params = sum(p.numel() for p in bundle.module.parameters())
    print(f"wrote {out} and {out.name}.data ({params:,} parameters, inputs "
          f"{', '.join(str(list(t.shape)) for t in bundle.example_inputs)})")
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    """The second form: every check that needs no work first, then the export."""
    if args.model is not None:
        raise InvalidInputError(f"MODEL {args.model!r} with --plan", expected="one of them",
                                found="both", fix="drop MODEL: the plan names its model")
    for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value is not None:
            raise InvalidInputError(f"{flag} with --plan", expected="the plan's shapes",
                                    found=f"{flag} {value}", fix=f"drop {flag}: the plan fixes it")
    # onnx takes ~0.8 s to import: only this command needs it.
    from planner.onnx_stages import check_output_folder, export_stages

    out = Path(args.output)
    if out.suffix.lower() == ".onnx":
        raise InvalidInputError(f"-o {args.output!r} with --plan", expected="a folder for the stage files",
                                found="a .onnx file name", fix=f"use -o {out.with_suffix('')}")
    check_output_folder(out)
    plan = load_plan(args.plan)
    if not is_onnx_spec(plan.model.spec):
        check_model_allowed(plan.model.spec, args.factory)  # before anything imports the model
    done = export_stages(plan, out, plan_path=args.plan, seed=args.seed)
    print(f"wrote {len(done.files)} stage files and {out / 'stages.json'} (from {done.manifest['source']}):")
    for stage in done.manifest["stages"]:
        ins = ", ".join(f"{t['name']}{t['shape']}" for t in stage["inputs"])
        outs = ", ".join(f"{t['name']}{t['shape']}" for t in stage["outputs"])
        print(f"  {stage['file']} ({', '.join(stage['blocks'])}): {ins} -> {outs}")
    return 0
