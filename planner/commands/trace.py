"""``stagewise trace MODEL``: trace a model and show its chain of blocks."""
from __future__ import annotations

import argparse
import json
import sys

from planner.coarsen import GRANULARITIES, chain_to_dict
from planner.commands._common import (
    add_model_argument,
    add_shape_arguments,
    seq_text,
    token_seq,
)
from planner.ir import BlockChain, Graph
from planner.model_io import load_chain

_MB = 1e6
_GFLOP = 1e9


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace", help="trace a model into blocks (FLOPs, parameters, activations)",
        description="Trace MODEL (a preset such as gpt-small or llama-7b, a package.module:factory, "
                    "or a file.onnx) on the meta device and print its chain of blocks, per microbatch.")
    add_model_argument(p)
    add_shape_arguments(p, batch_help="microbatch size to trace at (default 1)")
    p.add_argument("--granularity", choices=GRANULARITIES, default="layer",
                   help="layer: one block per top-level unit (default); fine: every legal cut")
    p.add_argument("--json", action="store_true", help="print the block chain as JSON instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:

    graph, chain = load_chain(args.model, batch=args.batch, seq=args.seq, granularity=args.granularity)
    if args.json:
        payload = chain_to_dict(chain)
        payload["graph"] = {"name": graph.name, "source": graph.source, "nodes": len(graph),
                            "fwd_flops": graph.fwd_flops, "bwd_flops": graph.bwd_flops,
                            "param_count": graph.param_count, "param_bytes": graph.param_bytes,
                            "buffer_bytes": graph.buffer_bytes, "seq": token_seq(graph)}
        json.dump(payload, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    _print_table(graph, chain)
    return 0


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _print_table(graph: Graph, chain: BlockChain) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{graph.name} ({graph.source}): {len(graph)} ops -> {len(chain)} blocks, "
                        f"microbatch {chain.microbatch_size}{seq_text(token_seq(graph))}")
    for col in ("#", "block", "nodes", "params", "fwd GFLOPs", "bwd GFLOPs", "saved act MB", "out MB"):
        table.add_column(col, justify="left" if col == "block" else "right")
    for b in chain.blocks:
        table.add_row(str(b.index), b.name, str(len(b.node_names)), human_count(b.param_count),
                      f"{b.fwd_flops / _GFLOP:.3f}", f"{b.bwd_flops / _GFLOP:.3f}",
                      f"{b.saved_act_bytes / _MB:.2f}", f"{b.out_bytes / _MB:.3f}")
    table.add_section()
    table.add_row("", "total", str(len(graph)), human_count(chain.param_count),
                  f"{chain.fwd_flops / _GFLOP:.3f}", f"{chain.bwd_flops / _GFLOP:.3f}",
                  f"{sum(b.saved_act_bytes for b in chain.blocks) / _MB:.2f}", "")
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # piped or captured: do not wrap the header at 80 columns
    console.print(table)
    if chain.tied_params:
        tied = ", ".join(f"{t.name} (blocks {', '.join(map(str, t.blocks))})" for t in chain.tied_params)
        console.print(f"tied parameters, counted in their first block: {tied}")
