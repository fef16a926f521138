"""Output outside a terminal (``planner.outputs.plain_output``): wide tables, no third-party progress bars."""
from __future__ import annotations

import io

from planner.outputs import PIPED_COLUMNS, plain_output


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_wide_tables_and_quiet_libraries():
    env: dict[str, str] = {}
    assert plain_output(io.StringIO(), env)
    assert env["COLUMNS"] == str(PIPED_COLUMNS)
    assert env["TQDM_DISABLE"] == "1" and env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert env["TRANSFORMERS_VERBOSITY"] == "error"


def test_a_terminal_and_the_users_own_settings_are_left_alone():
    env: dict[str, str] = {}
    assert not plain_output(_Terminal(), env) and env == {}
    env = {"COLUMNS": "100", "TQDM_DISABLE": "0"}
    plain_output(io.StringIO(), env)
    assert env["COLUMNS"] == "100" and env["TQDM_DISABLE"] == "0"
