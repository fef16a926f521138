"""The error hierarchy of Stagewise.

Every error raised for bad input says what was expected, what was found and how
to fix it, so the CLI can print it as one line and exit non-zero.
"""
from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """An exception's message on its first line alone (a library's next lines are its traceback or advice), for
    an error's ``found``."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else f"{type(exc).__name__} with no message"


class PlannerError(Exception):
    """Base class: one clear, user-facing message.

    ``what`` names the thing that is wrong (a field, a file, a device);
    ``expected``/``found``/``fix`` are optional parts joined into the message.
    """

    def __init__(self, what: str, *, expected: str | None = None,
                 found: str | None = None, fix: str | None = None) -> None:
        self.what = what
        self.expected = expected
        self.found = found
        self.fix = fix
        parts = [what]
        if expected is not None:
            parts.append(f"expected {expected}")
        if found is not None:
            parts.append(f"found {found}")
        if fix is not None:
            parts.append(f"fix: {fix}")
        super().__init__("; ".join(parts))


class InvalidInputError(PlannerError):
    """A model, file, preset, cluster or argument that cannot be used as given."""


class TraceError(InvalidInputError):
    """A model that neither torch.export nor torch.fx can trace."""


class InfeasiblePlanError(PlannerError):
    """No plan satisfies the constraints (memory, trust, policy)."""


class PlanMismatchError(PlannerError):
    """A plan that does not belong to the given model, cluster or version."""


class RankFailureError(PlannerError):
    """A rank of a running plan died, hung or reported an error."""


class ProtocolError(RankFailureError):
    """A rank sent what the runtime's protocol does not allow (a malformed message): ``peer`` names the
    sender, which is treated as faulty (the launcher blames it, a re-plan excludes its host)."""

    def __init__(self, what: str, *, sender: int, expected: str | None = None, found: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(what, expected=expected, found=found, fix=fix)
        self.peer = sender


class CheckpointError(InvalidInputError):
    """A checkpoint that cannot be trusted (corrupt, unsigned, or a file that is not what its manifest
    says); ``writer`` names the rank whose file it is, when a file is to blame (never the reader)."""

    def __init__(self, what: str, *, writer: int | None = None, expected: str | None = None,
                 found: str | None = None, fix: str | None = None) -> None:
        super().__init__(what, expected=expected, found=found, fix=fix)
        self.writer = writer
