"""The table ``stagewise run`` prints: verification rows, alerts among the flags."""
from __future__ import annotations

from rich.console import Console

from planner.commands.run import summary_table


def _text(result: dict) -> str:
    console = Console(width=200, record=True)
    console.print(summary_table(result))
    return console.export_text()


def _result(**extra) -> dict:
    return {"model": "gpt-tiny", "num_ranks": 4, "schedule": "1f1b", "steps": 10, "predicted_step_ms": 1.0,
            "measured_step_ms": 2.0, "final_loss": 3.0, "verified_boundaries": [0, 1], "flags": 7,
            "dropped": [0, 2], "banned": [], **extra}


def test_alerts_are_shown_among_the_flags_only_when_there_are_some():
    text = _text(_result(alerts=3))
    assert "verifier flags" in text and "of which alerts" in text
    (line,) = [line for line in text.splitlines() if "of which alerts" in line]
    assert line.replace("│", " ").split()[-1] == "3"
    assert "of which alerts" not in _text(_result(alerts=0))
    assert "microbatches dropped" in text
