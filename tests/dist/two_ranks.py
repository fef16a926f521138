"""Two gloo processes on a file store, each running one function: the harness of the small protocol tests."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.errors import RankFailureError


def _entry(rank: int, body: Callable[..., Any], store_path: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        outcome = {"ok": body(rank, *args)}
    except RankFailureError as exc:
        outcome = {"error": str(exc)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def two_ranks(tmp_path, body: Callable[..., Any], *args: Any) -> list[dict]:
    """``body(rank, *args)`` on ranks 0 and 1: per rank ``{"ok": its result}`` or ``{"error": the message}``."""
    mp.spawn(_entry, args=(body, str(tmp_path / "store"), str(tmp_path), args), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
