"""The run's one line on dropped microbatches and whether it dropped too many (the exit status says so)."""
from __future__ import annotations

from typing import Any

from planner.integrity.drops import reason_counts

# A run that dropped more than this share of its microbatches says so and exits with DROPS_EXIT_CODE.
DROP_LIMIT = 0.01
DROPS_EXIT_CODE = 3


def drops_line(result: dict[str, Any]) -> str | None:
    """One line: how many microbatches were dropped, of how many, and why (None for an unverified run)."""
    total = result.get("microbatches") or 0
    if "drops_total" not in result or not total:
        return None
    n = result["drops_total"]
    why = "; ".join(f"{k} x{v}" for k, v in reason_counts(result.get("drops", [])).items())
    return f"dropped {n} of {total} microbatches ({100.0 * n / total:.2f}%)" + (f", by reason: {why}" if why else "")


def too_many_drops(result: dict[str, Any]) -> bool:
    total = result.get("microbatches") or 0
    return bool(total) and result.get("drops_total", 0) > DROP_LIMIT * total
