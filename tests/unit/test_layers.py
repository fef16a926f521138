"""The project's imports point one way (docs/CONTRACTS.md, "Layers"): no cycles, nothing upward.

Every ``import`` of the project's own modules counts: at module level, under
``TYPE_CHECKING`` and inside functions. A function-level project import is
allowed only where it defers a heavy optional dependency, listed in DEFERRED.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("planner", "cost_models", "models")

# Lowest first; a module may import its own layer or any lower one. Longest prefix wins.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("planner.errors", "planner.ir", "planner.instructions", "planner.verifier_config", "planner.outputs",
     "planner.secret", "planner.random_ops"),                                        # base
    ("models",),                                                                     # reference models, data
    ("planner.flops", "planner.trace", "planner.trace_builder", "planner.trace_fx", "planner.trace_error",
     "planner.onnx_import", "planner.onnx_file", "planner.onnx_importer", "planner.onnx_export",
     "planner.coarsen", "planner.model_io",
     "planner.meta_twin"),
    ("cost_models",),
    ("planner.solver.problem", "planner.solver.problem_build", "planner.solver.problem_memo", "planner.solver.solution",
     "planner.solver.policy", "planner.solver.routing",
     "planner.solver.in_flight", "planner.solver.verdict_backlog", "planner.solver.drain_schedule",
     "planner.solver.drain_device", "planner.solver.drain_order", "planner.solver.drain_replay",
     "planner.solver.program_cost", "planner.solver.program_traffic", "planner.solver.program_paths",
     "planner.solver.program_resources", "planner.solver.program_audits",
     "planner.solver.objective", "planner.solver.verifiers", "planner.solver.audit_price",
     "planner.solver.audit_stepper", "planner.solver.link_tests"),                   # the solver's core
    ("planner.solver.search", "planner.solver.shared_verifiers"),
    ("planner.solver.bound", "planner.solver.cpsat"),
    ("planner.solver",),                                                             # the orchestrator, report
    ("planner.plan", "planner.plan_values", "planner.plan_history", "planner.plan_json", "planner.plan_load",
     "planner.validate", "planner.instruction_costs", "planner.schedules", "planner.compile", "planner.check",
     "planner.onnx_stages"),
    ("planner.simulate", "planner.simulate_events", "planner.simulate_run", "planner.simulate_audits",
     "planner.simulate_step_end", "planner.simulate_cores", "planner.gantt", "planner.rehearsal"),
    ("planner.api", "planner.rivals", "planner.replan"),
    ("planner.runtime.data", "planner.runtime.options", "planner.runtime.run_args"),  # what a run trains on, options
    ("planner.integrity",),                                                          # the verifier, beside the runtime
    ("planner.runtime.wire",),            # transfers, control messages (one author each), the verdict format
    ("planner.runtime.rank",),            # one rank's executor: stage, compute, p2p, verification, optimizer
    ("planner.runtime.recovery",),        # checkpoints, survivors' state, joins
    ("planner.runtime.outputs",),         # what a run reports
    ("planner.runtime.launcher", "planner.runtime", "planner.driver"),  # the processes, hosts, membership, re-planning legs
    ("planner.profiling",),                                                          # the only code that times hardware
    ("planner.commands", "planner.cli", "planner.__main__", "planner"),
)
# (importer, imported): why the import waits until it is needed.
# Every command imports at start-up (`stagewise plan` paid ~1.4 s for onnx and matplotlib it never used).
_ONNX = "onnx takes ~0.8 s to import: only ONNX models and exports need it"
DEFERRED: dict[tuple[str, str], str] = {
    ("planner.model_io", "planner.onnx_import"): _ONNX,
    ("planner.commands.export_onnx", "planner.onnx_import"): _ONNX,
    ("planner.commands.export_onnx", "planner.onnx_stages"): _ONNX,
    ("planner.commands.show", "planner.gantt"): "matplotlib takes ~0.6 s to import: only drawing needs it",
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported project module, inside a function) for every import statement of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        return []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            for name in targets(child):
                target = _resolve(name)
                if target and target != module:
                    found.append((target, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


EDGES = {m: _imports(m) for m in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_cycles():
    graph = nx.DiGraph((m, t) for m, edges in EDGES.items() for t, _ in edges)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_no_upward_imports():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, edges in EDGES.items() for t, _ in edges if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_function_level_project_imports():
    inner = sorted({(m, t) for m, edges in EDGES.items() for t, in_function in edges
                    if in_function and (m, t) not in DEFERRED})
    assert not inner, "function-level project imports (import at the top, or defer a heavy optional " \
                      "dependency and list it in DEFERRED): " + ", ".join(f"{m} -> {t}" for m, t in inner)


@pytest.mark.parametrize("bad", [("planner.errors", "cost_models.cluster"), ("cost_models.comm", "planner.solver.dp")])
def test_the_rule_catches_an_upward_import(bad):
    importer, imported = bad
    assert layer_of(imported) > layer_of(importer)
