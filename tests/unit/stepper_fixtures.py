"""A shared check of the auditor's stepper (``audit_stepper.Stepper``) in simulated runs."""
from __future__ import annotations

import pytest


def assert_checks_share_the_device(base, got, auditor: int, stepper) -> list:
    """Each of ``auditor``'s checks in the audited run ``got`` lasts what the stepper's sharing rule makes of the
    same check in the unaudited run ``base``; returns ``base``'s checks, earliest first."""
    alone = sorted((e for e in base.events if e.rank == auditor and e.kind == "verify"), key=lambda e: e.start_ms)
    shared = sorted((e for e in got.events if e.rank == auditor and e.kind == "verify" and "audit" not in e.label),
                    key=lambda e: e.start_ms)
    assert [e.label for e in shared] == [e.label for e in alone]
    for a, b in zip(alone, shared):
        assert b.end_ms - b.start_ms == pytest.approx(stepper.share(b.start_ms, a.end_ms - a.start_ms), rel=1e-9)
    return alone
