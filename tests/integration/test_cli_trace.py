"""``stagewise trace`` and ``stagewise export-onnx`` end to end (subprocesses, exit codes, stderr)."""
from __future__ import annotations

import json

import pytest

from planner.coarsen import chain_from_dict


def _one_clean_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_trace_preset_table(cli_here):
    proc = cli_here("trace", "gpt-tiny", "--batch", "2", "--seq", "16")
    assert proc.returncode == 0, proc.stderr
    for word in ("embed", "layers.3", "head", "total", "fwd GFLOPs"):
        assert word in proc.stdout
    assert proc.stderr == ""


def test_trace_json_is_a_block_chain(cli_here):
    proc = cli_here("trace", "llama-tiny", "--seq", "16", "--json", "--granularity", "layer")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    chain = chain_from_dict(data)
    assert [b.name for b in chain.blocks] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert chain.fwd_flops == data["graph"]["fwd_flops"] and chain.param_count == data["graph"]["param_count"]


@pytest.mark.parametrize("args, needle", [
    (("trace", "gpt-tinyy"), "unknown model 'gpt-tinyy'"),
    (("trace", "no_such_pkg.models:build"), "cannot import 'no_such_pkg.models'"),
    (("trace", "missing/model.onnx"), "no such file"),
    (("trace", "gpt-tiny", "--granularity", "layer", "--seq", "999"), "--seq 999"),
    (("trace", "tests.fixtures.trace_models:untraceable"), "cannot trace model"),
    (("export-onnx", "gpt-tiny", "-o", "model.txt"), "ending in .onnx"),
])
def test_bad_input_is_one_line_and_exit_2(cli_here, tmp_path, args, needle):
    assert needle in _one_clean_error_line(cli_here(*args, cwd=tmp_path))  # main, in this process


def test_corrupt_onnx_file(cli_here, tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x0a\xff\xff\xff\x0f garbage")
    assert "broken.onnx" in _one_clean_error_line(cli_here("trace", str(bad)))


def test_export_then_trace_onnx(run_cli, cli_here, tmp_path):
    out = tmp_path / "mlp.onnx"
    proc = run_cli("export-onnx", "mlp-tiny", "-o", str(out), "--batch", "4")
    assert proc.returncode == 0, proc.stderr
    assert out.is_file() and (tmp_path / "mlp.onnx.data").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx", "mlp.onnx.data"]  # no temp files left
    proc = cli_here("trace", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    chain = chain_from_dict(json.loads(proc.stdout))
    assert [b.name for b in chain.blocks] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert chain.microbatch_size == 4
    assert "batch" in _one_clean_error_line(cli_here("trace", str(out), "--batch", "8"))
