"""The README's promises that can rot: its Python API example runs as written, and its test command
is the one CI runs."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _section(heading: str) -> str:
    """The README's text under ``## heading`` up to the next ``## `` heading."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def test_python_api_example_runs_as_written(tmp_path, monkeypatch):
    blocks = _blocks(_section("Python API"), "python")
    assert len(blocks) == 1, "the Python API section should hold exactly one ```python block"
    monkeypatch.chdir(tmp_path)  # it writes plan.json where it runs
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(blocks[0], "README.md (Python API)", "exec"), namespace)
    assert (tmp_path / "plan.json").is_file()
    plan = namespace["plan"]
    assert plan.predicted.step_ms > 0
    assert namespace["stage"].index == 0


def test_readme_test_command_is_what_ci_runs():
    text = _section("Two commands")
    after = text.split("**Test suite**", 1)
    assert len(after) == 2, "the Two commands section should name the **Test suite** command"
    readme_command = _blocks(after[1], "bash")[0].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    commands = [line for line in ci_lines if line and not line.startswith("#")
                and not line.startswith(("set ", "cd "))]
    assert commands == [readme_command]
