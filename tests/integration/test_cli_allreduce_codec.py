"""A plan file's all-reduce codec from the command line: an unknown one is refused in one line (exit 2), and
``int8`` shows in ``stagewise show``'s stage table."""
from __future__ import annotations

import dataclasses
import json

from tests.unit.plan_fixtures import golden_plan


def test_an_unknown_all_reduce_codec_is_one_line_and_exit_2(cli_here, tmp_path):
    data = golden_plan().to_dict()
    data["stages"][0]["allreduce_codec"] = "zstd"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    res = cli_here("simulate", "plan.json", cwd=tmp_path)  # main, in this process
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert "allreduce_codec" in lines[0] and "'zstd' is not one of" in lines[0]


def test_show_names_a_replicated_stage_s_int8_all_reduce(cli_here, tmp_path):
    plan = golden_plan()
    replicated = [st.index for st in plan.stages if len(plan.stage_ranks(st.index)) > 1]
    assert replicated, "the golden plan has a replicated stage"
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, allreduce_codec="int8")
                                                  if st.index in replicated else st for st in plan.stages))
    plan.save(tmp_path / "plan.json")
    res = cli_here("show", "plan.json", "--out", "out", cwd=tmp_path)  # main, in this process
    assert res.returncode == 0, res.stderr
    row = [line for line in res.stdout.splitlines() if "TEST-GPU,TEST-SLOW" in line]   # the replicated stage
    assert len(row) == 1 and "int8" in row[0], res.stdout
