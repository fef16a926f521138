"""The ``stagewise`` command line.

Each subcommand lives in ``planner/commands/<name>.py`` and exposes
``register(subparsers)``; its handler returns an exit code. Any
:class:`~planner.errors.PlannerError` becomes one line on stderr and exit 2,
never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from planner.commands import (
    export_onnx,
    join,
    plan,
    profile,
    replan,
    run,
    show,
    simulate,
    trace,
)
from planner.errors import PlannerError
from planner.outputs import plain_output

# Order is the order shown in --help.
COMMANDS = (trace, profile, plan, show, simulate, run, replan, join, export_onnx)


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line too (argparse would print the whole usage before it)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="stagewise",
        description="Plan, simulate and run pipeline training on heterogeneous, partly untrusted devices.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_OneLineParser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    plain_output()  # piped: whole tables, no third-party progress bars
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except PlannerError as exc:  # a type= parser's error (argparse reports only ValueError and TypeError)
        print(f"stagewise: error: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args.handler(args) or 0)
    except PlannerError as exc:
        print(f"stagewise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stagewise {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
