"""Who is trusted comes from the operator's cluster, and the policy from the operator's run: a plan re-signed by
an invited worker (it holds the secret) that relabels a host, turns verification off, drops verifiers or moves a
stage onto an untrusted device is refused at load with one line saying what changed."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_models.cluster_file import cluster_source
from planner import secret
from planner.errors import InvalidInputError
from planner.plan_load import OperatorTrust, load_plan
from planner.runtime.launcher.membership import load_signed_plan
from planner.solver.policy import VerificationPolicy
from tests.dist.plans import local_cluster, make_plan

KEY = b"k" * 32
BOTH = ("act", "grad")


def _made(tmp_path: Path, directions=BOTH, policy=VerificationPolicy()) -> tuple[Path, Path]:
    """A signed 3-stage plan whose middle stage runs on the volunteer h1, checked by the verifier host, made
    from the operator's cluster file (recorded in the plan), and that file."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(local_cluster(3, verifier_host=True, untrusted=(1,)).to_dict()))
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 1), (2, 3), (4, 5)],
                     verifiers=[(0, 3, directions), (1, 3, directions)], verifier_host=True, untrusted=(1,))
    plan = dataclasses.replace(plan, policy=policy, cluster_source=cluster_source(cluster))
    return plan.save(tmp_path / "plan.json", secret=KEY), cluster


def _resigned(path: Path, edit) -> Path:
    """The plan as an insider would re-sign it after ``edit`` (the run secret is every worker's)."""
    data = json.loads(path.read_text())
    data.pop("signature")
    edit(data)
    data["signature"] = secret.sign(KEY, data)
    out = path.with_name("resigned.json")
    out.write_text(json.dumps(data))
    return out


def _host(data, name):
    return next(h for h in data["cluster"]["hosts"] if h["name"] == name)


def _refusal(path: Path, **operator) -> str:
    with pytest.raises(InvalidInputError) as err:
        load_signed_plan(path, KEY, operator=OperatorTrust(**operator))
    text = str(err.value)
    assert "\n" not in text
    return text


def test_the_plan_as_made_loads_and_records_its_cluster(tmp_path):
    path, cluster = _made(tmp_path)
    plan, _ = load_signed_plan(path, KEY, operator=OperatorTrust())
    assert plan.cluster_source == str(cluster.resolve())
    assert json.loads(path.read_text())["trust_digest"] == plan.trust_digest()
    load_signed_plan(path, KEY, operator=OperatorTrust(cluster=str(cluster)))


def test_a_volunteer_relabelled_trusted_is_refused(tmp_path):
    path, _ = _made(tmp_path)
    forged = _resigned(path, lambda d: _host(d, "h1").update(trusted=True, trust="operator"))
    load_plan(forged)  # its own copy is consistent: only the operator's cluster shows the forgery
    text = _refusal(forged)
    assert "differs from the operator's cluster" in text
    assert "host h1: trust \"rented\" in the operator's cluster, \"operator\" in the plan (and 1 more)" in text
    relabelled = _resigned(path, lambda d: _host(d, "h1").update(trusted=True))
    assert "host h1: trusted false in the operator's cluster, true in the plan" in _refusal(relabelled)


def test_a_stranger_host_may_only_join_untrusted(tmp_path):
    path, _ = _made(tmp_path)

    def add(trusted):
        return lambda d: d["cluster"]["hosts"].append({"name": "x9", "region": "local", "trust": "x9",
                                                       "trusted": trusted, "devices": [{"type": "CPU"}]})
    load_signed_plan(_resigned(path, add(False)), KEY, operator=OperatorTrust())
    assert "host x9: not in the operator's cluster, trusted true role worker in the plan" in \
        _refusal(_resigned(path, add(True)))


def test_verification_switched_off_is_refused_unless_the_operator_says_so(tmp_path):
    path, _ = _made(tmp_path)
    forged = _resigned(path, lambda d: d["policy"].update(enabled=False))
    assert "relaxes the operator's policy: policy enabled true for the operator, false in the plan" in \
        _refusal(forged)
    load_signed_plan(forged, KEY, operator=OperatorTrust(verify=False))  # run --no-verify: the operator's word


def test_dropped_verifiers_are_refused(tmp_path):
    path, _ = _made(tmp_path)
    text = _refusal(_resigned(path, lambda d: d.update(verifiers=[])))  # the programs still name them
    assert "nor verifies boundary 0" in text
    relaxed, _ = _made(tmp_path, directions=("act",), policy=VerificationPolicy(check_gradients=False))
    text = _refusal(relaxed)
    assert "relaxes the operator's policy: policy check_gradients true for the operator, false in the plan" in text
    assert "boundary 0 (grad) has an untrusted sender and no verifier" in text


def test_a_stage_moved_onto_an_untrusted_device_is_refused(tmp_path):
    path, _ = _made(tmp_path)

    def move(d):
        d["ranks"][0].update(device="h1/0", host="h1")
    text = _refusal(_resigned(path, move))
    assert "stage 0 is an endpoint but runs on untrusted h1/0" in text


def test_the_operators_cluster_flag_wins_and_a_missing_record_says_how_to_fix(tmp_path):
    path, cluster = _made(tmp_path)
    stricter = tmp_path / "stricter.json"
    data = json.loads(cluster.read_text())
    next(h for h in data["hosts"] if h["name"] == "h2").update(trusted=False)
    stricter.write_text(json.dumps(data))
    assert "host h2: trusted false in the operator's cluster, true in the plan" in _refusal(path, cluster=str(stricter))
    cluster.unlink()
    text = _refusal(path)
    assert "recorded in the plan, cannot be read" in text and "--cluster" in text
