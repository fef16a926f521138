"""Join requests: what a request may ask (checked against the run's plan), the signed file, the watcher
that rejects bad requests without stopping anything, and `replan` adding a new host (history `join`)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from plan_fixtures import TEST_DEVICE, block, chain, cluster, compile_simple, solution

from planner.api import plan_chain
from planner.replan import replan
from planner.errors import InvalidInputError
from planner.plan_history import HistoryEntry
from planner.runtime.recovery import joins
from planner.solver.policy import VerificationPolicy

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
NEW_HOST = """name: v9
region: r
trust: v9
trusted: false
devices: [{type: TEST-GPU, count: 2, spec: {name: TEST-GPU, kind: gpu, peak_flops: {float32: 10000000000000},
           mem_bytes: 17179869184, mem_bw_bytes_per_s: 500000000000, efficiency: 0.5}}]
"""


@pytest.fixture(scope="module")
def plan():
    """Two stages on h0 and h1; ``spare`` is in the cluster but excluded."""
    ch = chain([block(i) for i in range(4)])
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1), ("spare", TEST_DEVICE, 1)])
    base = compile_simple(ch, cl, solution([(0, 1), (2, 3)], [("h0/0",), ("h1/0",)], 4),
                          VerificationPolicy(enabled=False))
    return dataclasses.replace(base, excluded_hosts=("spare",))


def _described(tmp_path, text=NEW_HOST, name="v9.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_readmission_and_a_new_host_are_asked_for(plan, tmp_path):
    back = joins.make_request(plan, host="spare", why="repaired")
    assert back.readmission and back.describe() == "spare joined (re-admitted): repaired"
    assert back.model_fingerprint == plan.model.fingerprint
    new = joins.make_request(plan, description=_described(tmp_path))
    assert not new.readmission and new.host == "v9"
    assert new.new_host["devices"] == [{"type": "TEST-GPU", "spec": new.new_host["devices"][0]["spec"], "count": 2}]
    assert new.describe() == "v9 joined (new host, 2 x TEST-GPU, trust v9): by the operator"
    # one host of a cluster file is read the same way
    listed = _described(tmp_path, "hosts:\n  - " + NEW_HOST.replace("\n", "\n    "), name="cluster.yaml")
    assert joins.make_request(plan, description=listed).new_host == new.new_host


@pytest.mark.parametrize("kwargs,text,message", [
    (dict(host="h9"), None, "join host 'h9'.*not in the cluster, not described.*--describe"),
    (dict(host="h1"), None, "join host 'h1'.*found in the plan already"),
    (dict(), NEW_HOST.replace("name: v9", "name: h0"), "join host 'h0'.*found in the plan already"),
    (dict(), NEW_HOST.replace("name: v9", "name: spare"), "join host 'spare'.*re-admit it by name"),
    (dict(), NEW_HOST.replace("type: TEST-GPU, count: 2, spec:", "type: TPU-9, count: 2, specs:"),
     "--describe .*v9.yaml: host 'v9': devices"),
    (dict(), "name: v9\nregion: [unclosed\n", "--describe .*line 3: invalid YAML"),
    (dict(), "- just\n- a list\n", "expected a host with a name"),
    (dict(), "hosts: [{name: a}, {name: b}]\n", "exactly one host"),
    (dict(host="spare"), NEW_HOST, "found both"),
])
def test_bad_requests_are_refused(plan, tmp_path, kwargs, text, message):
    description = _described(tmp_path, text) if text is not None else None
    with pytest.raises(InvalidInputError, match=message):
        joins.make_request(plan, description=description, **kwargs)


def test_request_files_are_signed_and_one_per_host(plan, tmp_path):
    folder = tmp_path / "joins"
    request = joins.make_request(plan, host="spare", why="repaired")
    path = joins.write_request(folder, request, KEY)
    assert path.name == "join-spare.json" and not [p for p in folder.iterdir() if p.name.startswith(".")]
    assert joins.read_request(path, KEY) == request
    with pytest.raises(InvalidInputError, match="does not match its signature"):
        joins.read_request(path, OTHER_KEY)
    with pytest.raises(InvalidInputError, match="join-spare.json waiting already"):
        joins.write_request(folder, joins.make_request(plan, host="spare"), KEY)
    data = json.loads(path.read_text())
    data["host"] = "h0"  # an edit after signing
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInputError, match="does not match its signature"):
        joins.read_request(path, KEY)


@pytest.mark.parametrize("content,message", [
    ("not json", "not JSON"),
    ('{"host": "spare"}', "required"),
    ("x" * (joins.MAX_BYTES + 1), "at most"),
])
def test_malformed_request_files(tmp_path, content, message):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(InvalidInputError, match=message):
        joins.read_request(path, KEY)


def test_the_watcher_rejects_bad_requests_and_keeps_the_good_one(plan, tmp_path, capsys):
    folder = tmp_path / "joins"
    good = joins.write_request(folder, joins.make_request(plan, host="spare"), KEY)
    other_model = dataclasses.replace(joins.make_request(plan, host="spare"), model_fingerprint="0" * 64)
    (folder / "other.json").write_text(json.dumps({**other_model.to_dict(),
                                                   "signature": joins.secret.sign(KEY, other_model.to_dict())}))
    (folder / "garbage.yaml").write_text("host: spare\n")
    (folder / ".half-written.tmp").write_text("{")
    watcher = joins.JoinWatcher(folder=folder, plan=plan, key=KEY)
    assert watcher.waiting()
    (join,) = watcher.take()
    assert join.path == good and join.request.host == "spare"
    assert sorted(p.name for p in folder.iterdir()) == [".half-written.tmp", "garbage.yaml.rejected", "join-spare.json",
                                                        "other.json.rejected"]
    assert {r["file"].rsplit("/", 1)[1]: r["error"].split(";")[0] for r in watcher.rejected} == {
        "garbage.yaml.rejected": f"join request {folder / 'garbage.yaml'}: not JSON",
        "other.json.rejected": "join host 'spare': the request is for another model"}
    assert "garbage.yaml rejected" in capsys.readouterr().err
    watcher.accept([join])
    assert (folder / "join-spare.json.joined").is_file() and not watcher.take()


def test_two_requests_for_one_host_take_the_first(plan, tmp_path):
    folder = tmp_path / "joins"
    first = joins.write_request(folder, joins.make_request(plan, host="spare", why="one"), KEY)
    second = folder / "copy.json"
    second.write_text(first.read_text())
    os.utime(second, (first.stat().st_mtime + 1, first.stat().st_mtime + 1))
    watcher = joins.JoinWatcher(folder=folder, plan=plan, key=KEY)
    assert [j.path for j in watcher.take()] == [first]
    assert "asks for it too" in watcher.rejected[0]["error"]


def test_a_watcher_that_no_longer_sees_a_request_says_none_waits(plan, tmp_path):
    folder = tmp_path / "joins"
    path = joins.write_request(folder, joins.make_request(plan, host="spare"), KEY)
    watcher = joins.JoinWatcher(folder=folder, plan=plan, key=KEY, period_s=0.0)
    assert watcher.waiting()
    path.unlink()  # withdrawn by the operator
    assert not watcher.waiting() and watcher.rejected == []


# --------------------------------------------------------------------------- replan
@pytest.fixture(scope="module")
def planned():
    ch = chain([block(i) for i in range(4)])
    cl = cluster([("h0", TEST_DEVICE, 1), ("h1", TEST_DEVICE, 1)])
    return plan_chain(ch, cl, spec="tests:toy", global_batch=8, policy=VerificationPolicy(enabled=False),
                      time_limit_s=1.0, workers=1)


def test_replan_adds_a_new_host(planned, tmp_path):
    request = joins.make_request(planned, description=_described(tmp_path), why="new card")
    new = replan(planned, add_hosts=[request.new_host], reason=request.describe(), time_limit_s=1.0, workers=1)
    assert [h["name"] for h in new.cluster["hosts"]] == ["h0", "h1", "v9"] and new.excluded_hosts == ()
    assert "v9" in {r.host for r in new.ranks}  # two more devices as fast: the solver uses them
    last = new.history[-1]
    assert (last.event, last.readmitted_hosts, last.excluded_hosts) == ("join", ("v9",), ())
    assert last.summary().split(": ", 1)[1].startswith("joined v9; v9 joined (new host, 2 x TEST-GPU")
    assert new.report.notes[0].startswith("replanned with v9 joined: v9 joined")
    with pytest.raises(InvalidInputError, match="add host 'h1'.*in the cluster already"):
        replan(planned, add_hosts=[{**request.new_host, "name": "h1"}], reason="x", time_limit_s=0.5, workers=1)


def test_a_join_history_entry_adds_hosts_and_excludes_none():
    when = "2026-12-03T10:00:00Z"
    entry = HistoryEntry(event="join", when_utc=when, reason="v9 joined", readmitted_hosts=("v9",), previous_ranks=2,
                         previous_step_ms=1.0)
    assert entry.summary() == f"{when} join: joined v9; v9 joined (was 2 ranks, simulated step 1.000 ms)"
    with pytest.raises(InvalidInputError, match="'join'.*hosts that joined and none excluded"):
        dataclasses.replace(entry, excluded_hosts=("h0",))
