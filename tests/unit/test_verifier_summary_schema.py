"""A verifier's own summary passes the schema the control rank checks every run summary against: a key the
verifier adds and the schema lacks makes every verifying rank a protocol breaker at the run's end (the audits'
``refuted_flags`` did, failing every audited dist run)."""
from __future__ import annotations

import json

import torch

from planner.integrity.verifier import Verifier
from planner.runtime.outputs.run_report import RANK_FINAL_SCHEMA
from planner.runtime.wire import messages
from planner.verifier_config import VerifierConfig


def test_a_verifiers_audit_summary_is_a_valid_run_summary():
    v = Verifier(VerifierConfig().to_dict(), [(0, "grad")], stage_of={3: 1}, microbatches={3: 2})
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        for mb in range(2):
            v.check(0, "grad", torch.randn(4, 8, generator=gen), step=step, mb=mb, sender=3)
            v.record_audit(3, step, passed=mb == 0, mb=mb, boundary=0, direction="grad")
        v.end_step(step, [v.flag_events(step)])
    v.record_signed(forged=1, voided=0)
    v.suspend_audits(1, 2)
    audits = v.summary()["audits"]
    final = {"rank": 0, "stage": 0, "device_type": "cpu", "fwd_factor": 1.0, "bwd_factor": 1.0,
             "verification": {"flags": 0, "audits": audits}, "bans": [], "attacked": []}
    got = messages.decode(json.dumps(final).encode(), sender=0, what="run summary", schema=RANK_FINAL_SCHEMA)
    assert got["verification"]["audits"] == audits and audits["run"] == 6
