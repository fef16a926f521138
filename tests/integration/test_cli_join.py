"""`stagewise join` end to end: a request for an excluded host or a new one is written, signed, into the run's
join folder; bad input is one line and exit 2 with nothing written (the command's main in this process: each
`stagewise` process spends seconds importing torch); and a run whose join folder holds only bad requests sets
them aside and runs to its end on its plan (`stagewise run --join-dir`)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from planner.cli import main
from planner.runtime.recovery import joins
from planner.secret import run_secret
from tests.dist.plans import make_plan

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
NEW_HOST = "name: v9\nregion: local\ntrust: v9\ntrusted: false\ndevices: [{type: CPU, count: 1}]\n"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


@pytest.fixture(scope="module")
def plan():
    """Two stages on h0 and h1 of a cluster whose third host, h2, the plan excludes."""
    base = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    spare = {**base.cluster["hosts"][1], "name": "h2"}
    return dataclasses.replace(base, cluster={**base.cluster, "hosts": [*base.cluster["hosts"], spare]},
                               excluded_hosts=("h2",))


@pytest.fixture
def plan_path(plan, tmp_path):
    return plan.save(tmp_path / "plan.json")


def _join_error(capsys, *args: str) -> str:
    """``stagewise join ARGS`` in this process: exit 2 and one line on stderr, which is returned."""
    try:
        code = main(["join", *args])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stagewise join: error: "), err
    return lines[0]


def test_join_writes_signed_requests_for_an_excluded_host_and_a_new_one(plan, plan_path, tmp_path, capsys):
    folder = tmp_path / "ckpt" / joins.FOLDER
    folder.mkdir(parents=True)
    proc = cli("join", str(plan_path), "--host", "h2", "--why", "repaired", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    assert f"join request written: {folder / 'join-h2.json'} (h2 joined (re-admitted): repaired)" in proc.stdout
    (tmp_path / "v9.yaml").write_text(NEW_HOST)
    proc = cli("join", str(plan_path), "--describe", str(tmp_path / "v9.yaml"), "--join-dir", str(folder))
    assert proc.returncode == 0, proc.stderr
    key = run_secret()
    back, new = (joins.read_request(folder / name, key) for name in ("join-h2.json", "join-v9.json"))
    assert back.readmission and back.why == "repaired" and back.model_fingerprint == plan.model.fingerprint
    assert new.new_host == {"name": "v9", "region": "local", "trust": "v9", "trusted": False,
                            "devices": [{"type": "CPU", "count": 1}]}
    watcher = joins.JoinWatcher(folder=folder, plan=plan, key=key)
    assert [j.request.host for j in watcher.take()] == ["h2", "v9"] and watcher.rejected == []
    # one request per host waits at a time
    assert "join-h2.json waiting already" in _join_error(capsys, str(plan_path), "--host", "h2", "--join-dir",
                                                         str(folder))


@pytest.mark.parametrize("args,describe,message", [
    (("--host", "h9"), None, "join host 'h9'; expected a host of the plan's cluster"),
    (("--host", "h0"), None, "join host 'h0'; expected a host the plan leaves out (h2)"),
    ((), NEW_HOST.replace("name: v9", "name: h1"), "join host 'h1'; expected a host the plan leaves out"),
    ((), "name: v9\ndevices: [{type: CPU\n", "invalid YAML"),
    ((), "[1, 2]\n", "expected a host with a name"),
    ((), NEW_HOST.replace("type: CPU", "type: ABACUS"), "host 'v9': devices[0].type"),
])
def test_bad_requests_are_one_line_and_write_nothing(plan_path, tmp_path, capsys, args, describe, message):
    folder = tmp_path / "joins"
    folder.mkdir()
    if describe is not None:
        (tmp_path / "host.yaml").write_text(describe)
        args = ("--describe", str(tmp_path / "host.yaml"))
    assert message in _join_error(capsys, str(plan_path), *args, "--join-dir", str(folder))
    assert list(folder.iterdir()) == []


def test_a_mistyped_folder_a_missing_host_and_an_edited_plan_are_refused(plan_path, tmp_path, capsys):
    line = _join_error(capsys, str(plan_path), "--host", "h2", "--checkpoint-dir", str(tmp_path / "nope"))
    assert "no such folder" in line and not (tmp_path / "nope").exists()
    assert "one of the arguments --host --describe is required" in _join_error(capsys, str(plan_path), "--join-dir",
                                                                               str(tmp_path))
    data = json.loads(plan_path.read_text())
    data["excluded_hosts"] = []  # h2 "back" in the plan by hand: not the plan the run was given
    plan_path.write_text(json.dumps(data))
    assert "does not match its signature" in _join_error(capsys, str(plan_path), "--host", "h2", "--join-dir",
                                                         str(tmp_path))


def test_bad_requests_are_set_aside_and_the_run_goes_on(plan, plan_path, tmp_path):
    folder = tmp_path / "joins"
    folder.mkdir()
    (folder / "truncated.json").write_text('{"kind": "stagewise join request", "host": ')
    (folder / "by-hand.yaml").write_text("host: h2\n")  # no signature: anyone could have dropped it
    planned = dataclasses.replace(joins.make_request(plan, host="h2"), host="h1")  # signed, but h1 runs already
    joins.write_request(folder, planned, run_secret())
    report = tmp_path / "report.json"
    proc = cli("run", str(plan_path), "--steps", "3", "--timeout", "60", "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--checkpoint-every", "1", "--join-dir", str(folder), "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["by-hand.yaml.rejected", "join-h1.json.rejected",
                                                        "truncated.json.rejected"]
    data = json.loads(report.read_text())
    assert data["steps"] == 3 and data["replans"] == [] and "joined" not in data
    errors = {r["file"].rsplit("/", 1)[1]: r["error"] for r in data["joins_rejected"]}
    assert "not JSON" in errors["truncated.json.rejected"] and "not JSON" in errors["by-hand.yaml.rejected"]
    assert "join host 'h1'; expected a host the plan leaves out (h2)" in errors["join-h1.json.rejected"]
    assert proc.stdout.count("join request rejected: ") == 3
