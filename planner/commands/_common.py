"""What several ``stagewise`` subcommands share: argument definitions, plan loading, the rank table."""
from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel
from planner.plan import Plan
from planner.plan_load import load_plan
from planner.simulate import SimResult, simulate

MODEL_HELP = "preset name, package.module:factory, or path to a .onnx file"
BUILDABLE_MODEL_HELP = "preset name or package.module:factory"
SEQ_HELP = "sequence length (LMs) or image side (CNNs)"


def process_started_s() -> float:
    """When this process started, on the ``time.perf_counter`` clock: a user's ``--time-limit`` counts from
    the moment they ran the command, so the interpreter's start and the imports are inside it."""
    return time.perf_counter() - process_age_s()


def process_age_s() -> float:
    """Seconds since this process started."""
    try:  # Linux: start in clock ticks since boot (field 22 of stat) against the uptime, 10 ms resolution
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil  # elsewhere: the creation time, whole seconds of boot time on some systems
        return max(0.0, time.time() - psutil.Process().create_time())


def add_model_argument(p: argparse.ArgumentParser, *, onnx: bool = True) -> None:
    """The positional ``MODEL``; ``onnx=False`` for commands that need a model they can build."""
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP if onnx else BUILDABLE_MODEL_HELP)


def add_shape_arguments(p: argparse.ArgumentParser, *, batch_help: str, batch_default: int | None = None) -> None:
    """``--batch`` and ``--seq``: the input shape a model is built or traced at."""
    p.add_argument("--batch", type=int, default=batch_default, help=batch_help)
    p.add_argument("--seq", type=int, default=None, help=SEQ_HELP)


def token_seq(graph: Any) -> int | None:
    """The sequence length a language model was traced at: its one input is a batch of token ids
    (integers, batch x seq); None for any other model."""
    inputs = graph.inputs()
    if len(inputs) != 1 or len(inputs[0].outputs) != 1:
        return None
    meta = inputs[0].outputs[0]
    return meta.shape[1] if len(meta.shape) == 2 and meta.dtype.startswith(("int", "uint")) else None


def seq_text(seq: int | None) -> str:
    """``, seq T`` for a language model, else nothing."""
    return f", seq {seq}" if seq is not None else ""


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Raise for any of the integer options ``names`` given as less than 1 (unset options pass)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise InvalidInputError(flag, expected=">= 1", found=str(value), fix=f"pass {flag} 1 or more")


def check_seconds(args: argparse.Namespace, *names: str) -> None:
    """Raise for any of the duration options ``names`` that is not a finite number of seconds above 0
    (nan and inf included: a limit of nan never ends a search; unset options pass)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            flag = "--" + name.replace("_", "-")
            raise InvalidInputError(flag, expected="a finite number of seconds > 0", found=str(value),
                                    fix=f"pass e.g. {flag} 30")


def add_plan_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `stagewise plan`")


def load_and_simulate(path: str) -> tuple[Plan, CostModel, SimResult]:
    """Load and validate a plan file, price it and simulate one step."""

    plan = load_plan(path)
    costs = CostModel.for_plan(plan)
    return plan, costs, simulate(plan, costs)


def rank_table(plan: Plan, result: SimResult, costs: CostModel, title: str) -> Any:
    """Per rank: device, role, microbatches, busy/idle time, activations in flight, peak memory."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("rank", "device", "role", "mbs", "busy ms", "idle ms", "in flight", "memory GiB"):
        table.add_column(col, justify="left" if col in ("device", "role") else "right")
    for info in plan.ranks:
        r = info.rank
        role = plan.rank_role(r)
        if info.verifies:
            role += f" +v{','.join(map(str, info.verifies))}"
        mem_total = costs.spec[r].mem_bytes
        peak = result.peak_mem_bytes[r]
        table.add_row(str(r), info.device_type, role, str(len(info.microbatches)),
                      f"{result.busy_ms[r]:.1f}", f"{result.idle_ms[r]:.1f}",
                      f"{result.peak_in_flight[r]}/{info.max_in_flight}" if info.stage is not None else "-",
                      f"{peak / 2**30:.2f}/{mem_total / 2**30:.0f}", style="bold red" if peak > mem_total else None)
    return table


def over_memory_ranks(plan: Plan, result: SimResult, costs: CostModel) -> list[int]:
    """Ranks whose simulated peak memory exceeds their device's memory."""
    return [info.rank for info in plan.ranks if result.peak_mem_bytes[info.rank] > costs.spec[info.rank].mem_bytes]
