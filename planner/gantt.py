"""Gantt chart of one simulated step: one row per rank, one box per instruction.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display
needed), saved as PNG and/or SVG. Colours: forward, backward,
send (a thin bar at the bottom of the sender's row, for as long as the
transfer occupies the link), verify, all-reduce, optimizer step and, where
messages are priced, a rank's CPU time on a message. Each
forward/backward/verify box carries its microbatch number when it is wide
enough to read.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from planner.outputs import atomic_file
from planner.plan import Plan
from planner.simulate_events import Event, SimResult

COLOURS = {
    "F": "#4c78a8",        # forward: blue
    "B": "#f58518",        # backward: orange
    "send": "#9d9d9d",     # transfers: grey
    "verify": "#b279a2",   # verification: purple
    "allreduce": "#54a24b",  # all-reduce: green
    "optim": "#e45756",    # optimizer step: red
    "message": "#72b7b2",  # a rank's CPU time on a message (simulate(messages=...)): teal
    "control": "#eeca3b",  # waiting for the step's verdict (flags, blame, the lead's decision): yellow
}
LEGEND = (("F", "forward"), ("B", "backward"), ("send", "send (link busy)"), ("verify", "verify"),
          ("allreduce", "all-reduce"), ("optim", "optimizer step"), ("message", "message CPU"),
          ("control", "verdict exchange"))
_BOX_H = 0.72
_SEND_H = 0.2


def _row_label(plan: Plan, rank: int) -> str:
    info = plan.ranks[rank]
    return f"rank {rank}: {plan.rank_role(rank)}\n{info.device_type} ({info.device})"


def _box_text(ev: Event) -> str:
    if ev.kind in ("F", "B"):
        return str(ev.mb)
    if ev.kind == "verify":
        return f"v{ev.mb}"
    return {"allreduce": "AR", "optim": "opt"}.get(ev.kind, "")


def _send_lanes(events: tuple[Event, ...]) -> dict[tuple[int, int | None], tuple[int, int]]:
    """(rank, peer) -> (sub-lane, number of sub-lanes of that rank), peers in order of first send."""
    peers: dict[int, list[int | None]] = {}
    for ev in events:
        if ev.kind == "send" and ev.peer not in peers.setdefault(ev.rank, []):
            peers[ev.rank].append(ev.peer)
    return {(rank, p): (i, len(ps)) for rank, ps in peers.items() for i, p in enumerate(ps)}


def draw(plan: Plan, result: SimResult, *, title: str | None = None) -> Figure:
    """A matplotlib Figure of ``result``'s timeline (rank 0 at the top)."""
    n = plan.num_ranks
    span = max(result.step_ms, 1e-9)
    fig = Figure(figsize=(max(10.0, min(24.0, 4.0 + 0.35 * len(result.events) / max(n, 1))), 1.0 + 0.75 * n),
                 dpi=110, layout="constrained")
    ax = fig.add_subplot()
    inches_per_ms = fig.get_figwidth() * 0.8 / span
    lanes = _send_lanes(result.events)
    for ev in result.events:
        y = n - 1 - ev.rank
        width = ev.end_ms - ev.start_ms
        if ev.kind == "send":  # one thin sub-lane per destination, so concurrent sends stay apart
            lane, count = lanes[(ev.rank, ev.peer)]
            h = _SEND_H / count
            ax.broken_barh([(ev.start_ms, width)], (y - _BOX_H / 2 + lane * h, h * 0.85),
                           facecolors=COLOURS["send"])
            continue
        ax.broken_barh([(ev.start_ms, width)], (y - _BOX_H / 2 + _SEND_H, _BOX_H - _SEND_H),
                       facecolors=COLOURS[ev.kind], edgecolors="white", linewidth=0.6)
        text = _box_text(ev)
        # Print the label only where it fits: about 0.08 inch per character at 7 pt.
        if text and width * inches_per_ms >= 0.08 * len(text) + 0.02:
            ax.text(ev.start_ms + width / 2, y + _SEND_H / 2, text, ha="center", va="center", fontsize=7,
                    color="white", fontweight="bold")
    ax.set_yticks(range(n), [_row_label(plan, r) for r in reversed(range(n))], fontsize=8)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    heading = title or (f"{plan.model.name}: {plan.schedule.upper()}, {plan.num_stages} stages, "
                        f"{plan.num_microbatches} microbatches on {plan.cluster.get('name', 'cluster')}")
    ax.set_title(f"{heading}\nstep {result.step_ms:.2f} ms, bubble {100 * result.bubble_fraction:.1f}%",
                 fontsize=10)
    kinds = {ev.kind for ev in result.events}
    handles = [Patch(facecolor=COLOURS[k], label=label) for k, label in LEGEND
               if k not in ("message", "control") or k in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    return fig


def save(fig: Figure, paths: Iterable[str | os.PathLike]) -> tuple[Path, ...]:
    """Save ``fig`` to each path (format from the suffix), atomically (temp file + os.replace)."""
    written = []
    for path in paths:
        target = Path(path)
        fmt = target.suffix.lstrip(".").lower()
        # A fixed SVG id salt and no date: redrawing the same plan gives the same bytes (clean diffs).
        stable = {"metadata": {"Date": None}} if fmt == "svg" else {}
        with atomic_file(target, binary=True) as fh, rc_context({"svg.hashsalt": "stagewise"}):
            fig.savefig(fh, format=fmt, **stable)
        written.append(target)
    return tuple(written)


def write_gantt(plan: Plan, result: SimResult, stem: str | os.PathLike,
                formats: tuple[str, ...] = ("png", "svg")) -> tuple[Path, ...]:
    """Draw and write ``<stem>.png`` and ``<stem>.svg``; returns the paths written."""
    fig = draw(plan, result)
    return save(fig, [Path(f"{os.fspath(stem)}.{fmt}") for fmt in formats])
