"""The runtime benchmark's predictions: a case's plan priced with fresh profiles of this CPU."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._runtime_runs import busy_s
from benchmarks._runtime_setup import (
    Machine,
    cluster,
    compile_solution,
    hand_solution,
    profile_cpu,
)

__all__ = ["SLOW", "pct", "price_case", "priced_step_ms", "profile_summary", "timed_profile"]


SLOW = 1.0 / 3.0  # efficiency scale of the emulated slow device


def pct(measured: float, predicted: float) -> float:
    return 100.0 * (measured - predicted) / predicted if predicted else float("nan")


def profile_summary(profile: Path) -> dict[str, Any]:
    doc = json.loads(profile.read_text())
    layers = [b for b in doc["blocks"] if b["name"].startswith("layers.")]
    return {"efficiency": doc["device"]["efficiency"], "op_overhead_ms": doc["device"]["op_overhead_ms"],
            "peak_scale": doc["calibration"]["peak_scale"],
            "layer_fwd_ms": statistics.median(b["fwd_ms"] for b in layers),
            "layer_bwd_ms": statistics.median(b["bwd_ms"] for b in layers),
            "fit_median_abs_rel_err": doc["calibration"]["median_abs_rel_err"]}


def priced_step_ms(path: Path, cores: int, sharing=None, *, emulated: bool = False, messages=None) -> float:
    """The step time of ``path``'s plan with its ranks sharing ``cores`` cores (see ``runtime.py``'s docstring),
    at the measured ``sharing`` speeds (None: even sharing), rehearsing slower devices by padding, with
    ``messages`` costing their ends CPU time (None: free)."""
    from planner.plan_load import load_plan
    from planner.simulate import simulate
    return simulate(load_plan(path), cores=cores, sharing=sharing, emulated=emulated, messages=messages).step_ms


def timed_profile(path: Path, **kw: bool) -> tuple[Path, float]:  # kw: profile_cpu's p2p, sharing, warm
    """A fresh profile, and the cores other processes kept busy while it measured (roughly, with
    ``sharing``: its workers' CPU time counts as others')."""
    wall, busy, own = time.perf_counter(), busy_s(), time.process_time()
    profile = profile_cpu(path, **kw)
    wall, busy, own = time.perf_counter() - wall, busy_s() - busy, time.process_time() - own
    return profile, round(max(0.0, (busy - own) / wall), 3)


def price_case(tmp: Path, ch, link, effs: list[float], stages, cores: int, machine: Machine, name: str,
            warm_first: bool = True) -> tuple[Path, dict[str, Any]]:
    """A fresh profile of this CPU, and the case's plan priced with it: ranks sharing ``cores`` cores at
    the measured speeds, messages costing CPU time, slower devices rehearsed by padding (``predicted_ms``);
    as before the probe held a stage's microbatches and messages cost CPU (``previous_model_ms``); and
    with even sharing, padding on a core (``even_sharing_ms``); and as ``predicted_ms`` with a second
    profile whose passes were timed warm, in a tight loop (``warm_profile_ms``; taken first with
    ``warm_first``, else second, so that both kinds are as near the run on average)."""
    emulated = min(effs) < max(effs)
    kinds = (True, False) if warm_first else (False, True)
    taken = {warm: timed_profile(tmp / f"cpu-{name}{'-warm' if warm else ''}.json", warm=warm) for warm in kinds}
    profile, load = taken[False]
    warm_cl = cluster(taken[True][0], effs, link)
    warm_path = compile_solution(hand_solution(ch, warm_cl, stages), ch, warm_cl, tmp, f"{name}-warm")
    cl = cluster(profile, effs, link)
    path = compile_solution(hand_solution(ch, cl, stages), ch, cl, tmp, name)
    return path, {**profile_summary(profile), "external_load_cores": load,
                  "warm_profile_ms": priced_step_ms(warm_path, cores, machine.sharing, emulated=emulated,
                                              messages=machine.messages),
                  "warm_layer_fwd_ms": profile_summary(taken[True][0])["layer_fwd_ms"],
                  "predicted_ms": priced_step_ms(path, cores, machine.sharing, emulated=emulated,
                                                 messages=machine.messages),
                  "previous_model_ms": priced_step_ms(path, cores, machine.previous_sharing, emulated=emulated),
                  "no_executor_ms": priced_step_ms(path, cores, machine.sharing, emulated=emulated,
                                             messages=machine.bare_messages),
                  "even_sharing_ms": priced_step_ms(path, cores)}
