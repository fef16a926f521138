"""The plan's schema_version moves with its schema: an older stagewise then refuses a newer plan by its version
(saying to upgrade), not by a schema error on a field it does not know."""
from __future__ import annotations

import hashlib
import json

from planner.plan_json import SCHEMA_VERSION, plan_schema

# schema_version -> sha256 of the schema as canonical JSON; a schema change adds a line here with a new version
SCHEMA_HASHES = {
    6: "50153b99a5d9d5a81e03ec328d65a9d953cc7c286cb83267ba97234ea37cd5bf",
    7: "d72e9de41b66577b6a664321fa3b9c492d787a0f9f37b1b7d66354e89acdfacd",
}


def test_schema_change_bumps_the_version():
    digest = hashlib.sha256(json.dumps(plan_schema(), sort_keys=True).encode()).hexdigest()
    assert SCHEMA_HASHES.get(SCHEMA_VERSION) == digest, (
        f"planner/schema/plan.schema.json changed (sha256 {digest}) under schema_version {SCHEMA_VERSION}: bump "
        "SCHEMA_VERSION in planner/plan_json.py, add the hash here and re-write the golden plan")
