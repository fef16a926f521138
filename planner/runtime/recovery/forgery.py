"""A test harness for the control plane: this rank behaves as a hostile worker's patched process would.

``STAGEWISE_TEST_FORGE="rank=R,kinds=K1+K2"`` makes rank R forge what it controls (a worker controls its
own process, so this gives a rank no power it lacks): the tests check that each forgery is refused or
blamed on its sender, never obeyed. Kinds:

* ``verdict``: at the end of every step, send every rank a verdict in the lead verifier's format that
  bans rank 0 and clears every other ban (never read: a verdict is received from the lead alone);
* ``summary``: its final summary claims it banned rank 0 (only verifier ranks report bans);
* ``record``: its error record claims a ban of rank 0 stopped the run (the launcher reads the control rank's);
* ``plant``: its checkpoint file also holds every other parameter of the model, set to 1000 (each
  parameter is restored from its owner's file only);
* ``swap``: after the manifest is written, its checkpoint file is rewritten with other values (refused
  on resume, blamed on it, the run falls back to the previous checkpoint).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.registry import build_model
from planner.errors import InvalidInputError
from planner.runtime.recovery import checkpoint
from planner.runtime.wire import bans as ban_exchange
from planner.runtime.wire import comm, control

ENV_VAR = "STAGEWISE_TEST_FORGE"
KINDS = frozenset({"verdict", "summary", "record", "plant", "swap"})


@dataclass(frozen=True, slots=True)
class Forgery:
    rank: int
    kinds: frozenset[str]

    @classmethod
    def for_rank(cls, rank: int) -> "Forgery | None":
        spec = os.environ.get(ENV_VAR)
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
        kinds = frozenset(fields.get("kinds", "").split("+"))
        if not fields.get("rank", "").isdigit() or not kinds <= KINDS:
            raise InvalidInputError(ENV_VAR, expected=f"rank=R,kinds=K1+K2 with kinds of {sorted(KINDS)}", found=spec)
        return cls(int(fields["rank"]), kinds) if int(fields["rank"]) == rank else None

    def verdict(self, plan, step: int, device: torch.device) -> list[comm.Pending]:
        """Send every rank a forged verdict (left pending: nobody posts its receive)."""
        if "verdict" not in self.kinds:
            return []
        forged = ban_exchange.encode(plan.num_ranks, unresolved={0: step}, bans={0: (step, step)},
                                     trained=len(plan.ranks[0].microbatches)).to(device)
        return [comm.send([forged], peer=r, kind=comm.Kind.CONTROL, boundary=int(control.Topic.VERDICTS), mb=0,
                          doing="forging a verdict") for r in range(plan.num_ranks) if r != self.rank]

    def summary(self, final: dict[str, Any]) -> dict[str, Any]:
        return {**final, "bans": [[0, 0]]} if "summary" in self.kinds else final

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        if "record" not in self.kinds:
            return record
        return {**record, "kind": ban_exchange.RankBannedError.__name__, "hosts": {"0": "forged"},
                "bans": [{"rank": 0, "first_flagged_step": 0, "ban_step": 0}], "error": "rank 0 banned (forged)"}

    def planted(self, plan, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``params`` plus every other parameter of the model at 1000 (what a poisoner would write)."""
        if "plant" not in self.kinds:
            return params
        model = build_model(plan.model.spec, batch=plan.config.microbatch_size, seq=plan.model.seq,
                            device="meta").module
        return {**{n: torch.full(p.shape, 1000.0) for n, p in model.named_parameters()}, **params}

    def swap(self, root: str | os.PathLike, step: int, fingerprint: str, params: dict[str, torch.Tensor]) -> None:
        """Rewrite this rank's file of a complete checkpoint with other values."""
        if "swap" not in self.kinds:
            return
        path = Path(checkpoint.step_folder(root, step)) / f"rank{self.rank}.safetensors"
        checkpoint.write_rank_file(path, step=step, rank=self.rank, fingerprint=fingerprint, optimizer=None,
                                   params={n: torch.full_like(p, 7.0) for n, p in params.items()}, state=None,
                                   rng=torch.get_rng_state())
