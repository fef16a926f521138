"""Does verification ban the honest, and does it catch the attacker, in the distributed runtime?

``stagewise run`` (one gloo process per rank on this machine, one thread each) on gpt-tiny plans of
four shapes, three over ``benchmarks/clusters/four-t4.yaml`` (four single-T4 hosts, trusted ends h0 and h3,
untrusted volunteers h1 and h2 in trust domains of their own), and on an HF Llama plan:

- ``split``: ``stagewise plan gpt-tiny --baseline uniform``: 4 stages, ranks 1 and 2 untrusted, the
  verifiers of each untrusted stage's two sides on different ranks, so no link or residual test (the
  plan's notes say so; issue 20's setup);
- ``linked``: the same with ``--link-tests-cost 3``: one verifier (rank 3) sees every boundary, the
  trusted inputs copied to it watch-only;
- ``replicated``: 3 stages, the middle one untrusted with two replicas (h1 and h2, 8 microbatches each),
  its verifiers placed as ``plan --link-tests-cost 5`` places them (one verifier, rank 0, for both
  sides). No ``stagewise plan`` option makes it on gpt-tiny (its checks outweigh its passes, so a
  replica saves nothing: the solver leaves the second volunteer idle, and ``--stages 3 --replicas 2``
  needs verifier sites the replicated ends lack), so it is compiled here from a hand-made placement
  through the planner's own steps (``_replicated``);
- ``replicated3``: the same with three replicas (h1, h2, h3 of ``benchmarks/clusters/five-t4.yaml``: 6, 5 and 5
  microbatches, the last stage on h4), one verifier (rank 0);
- ``replicated-audit``, ``replicated3-audit``: the replicated plans run with ``--audit-every 4`` (the runtime's
  audits, ``planner.runtime.rank.audits``: rank 0, the verifier of stage 1's outputs, recomputes a secret one in
  four of each replica's microbatches on its own copy of the stage; a failed audit bans at once; where it audited
  every microbatch of a replica's step, a suspect's, it also audits the replica's gradient contribution against
  its reported sketch, ``planner.runtime.rank.audit_contrib``; ``--audit-every N`` sets another share, recorded
  in each row); every other shape runs with ``--audit-every 0``, as its rows were measured before the runtime
  audited;
- ``hf-llama``: a tiny HF Llama (``HF_SPEC``, 4x32 tokens a microbatch, 3 microbatches a step) planned by
  ``planner.api.make_plan`` on the default cluster with 3 stages (tests/integration/test_run_drops.py's): the
  middle stage on a volunteer, verified (boundary 0's gradients on rank 0, boundary 1's activations on rank 2).
- ``split-audit``, ``hf-llama-audit``: those plans run with ``--audit-every 4``: no verifier holds an untrusted
  stage's input there, so the auditor (the verifier of its outputs) hears the audited inputs copied from the
  trusted stage before it (audits from copies). Split's stage 2 is fed by the untrusted stage 1: it is audited
  from signed inputs (``planner.runtime.rank.audit_signed``: stage 1 signs what it sends, stage 2 forwards the
  audited inputs under those signatures; the split-audit rows in the results were run so).
- ``copies-audit``: issue 37's own placement on four-t4 and a CPU verifier host: the replicated shape's stages, the
  host (rank 4, the lead and only verifier) checking boundary 0's gradients and boundary 1's activations, no link
  test; run with ``--audit-every 4`` (or as given): stage 1 is audited from copies, its inputs and the input
  gradients the replicas sent back copied by h0 and, the stage after being trusted, the gradients h3 sent them
  copied by h3 (``planner.runtime.rank.audit_grads``): forward and backward recomputed, and the replicas'
  contributions where every microbatch of theirs is audited.

Clean runs (no attacker) report, per run: steps, checks, flags (per microbatch and per step), dropped
microbatches, blamed (step, sender) pairs, bans, and the per-sample false-positive rate (microbatch
flags / checks; goal <= 0.1% and nobody banned). Attack runs (``ATTACKS``) report the attacker's ban
step relative to the attack's start (goal: within 10 steps, no honest rank banned) and the precision,
recall and F1 of the dropped microbatches against the attacked ones (the attacker's log), and over
(step, sender) pairs as ``verification.py`` scores the emulation (blamed against attacked); a run stops
at a ban, so both count up to the ban step. On ``hf-llama`` every attack runs on its one untrusted rank (1);
the ``params-*`` attacks (a replica's gradient contribution to its stage's all-reduce) run on the replicated
shapes only. Where an honest rank is banned or the attacker is not, the
row keeps the flag events around it (boundary, direction, reasons, upstream).

    python benchmarks/verification_dist.py                          # everything (about an hour here)
    python benchmarks/verification_dist.py --shapes split --seeds 0 --steps 12 --attacks none --out F.json
    python benchmarks/verification_dist.py --no-clean --attack-shapes replicated-audit replicated3-audit \
        --attacks params-scale3 params-sign params-noise                # the contribution audits' rows
    python benchmarks/verification_dist.py --quick   # a smoke run: the split and replicated plans made, one
                                                     # short clean run of split; everything in a temporary folder
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "benchmarks" / "clusters" / "four-t4.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "verification_dist.json"
CLUSTER3 = ROOT / "benchmarks" / "clusters" / "five-t4.yaml"
SHAPES = ("split", "linked", "replicated", "replicated3", "hf-llama", "replicated-audit", "replicated3-audit",
          "split-audit", "hf-llama-audit", "copies-audit")
ATTACK_SHAPES = ("split", "linked")
MODELS = {"hf-llama": "hf-llama-tiny", "hf-llama-audit": "hf-llama-tiny"}   # the model of a shape (default gpt-tiny)
HF_SPEC = ("hf:llama?hidden_size=64,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2,"
           "intermediate_size=128,vocab_size=256,max_position_embeddings=64")
# name -> the --attack spec without its start; every attack starts at ATTACK_START, a replay at DELAY_START
ATTACKS = {
    "scale0.5": "rank=1,kind=scale,factor=0.5",
    "noise0.2": "rank=2,kind=noise,std=0.2",
    "bias0.3": "rank=1,kind=bias,rel=0.3",
    "delay20": "rank=2,kind=delay,steps=20,p=0.5",
    "gradscale3": "rank=2,kind=scale,factor=3,dir=grad",
    # all-reduce poisoning: one replica's gradient contribution (replicated shapes only)
    "params-scale3": "rank=1,kind=scale,factor=3,dir=params",
    "params-sign": "rank=1,kind=scale,factor=-1,dir=params",
    "params-noise": "rank=1,kind=noise,std=1.0,dir=params",
}
AUDITED = {"replicated-audit": "replicated", "replicated3-audit": "replicated3", "split-audit": "split",
           "hf-llama-audit": "hf-llama", "copies-audit": "copies"}   # shape -> the plan it runs
AUDIT_EVERY = 4           # --audit-every of the audited shapes (planner.integrity.audit.DEFAULT_EVERY)
REPLICATED = ("replicated", "replicated3", "replicated-audit", "replicated3-audit", "copies-audit")
# copies-audit: four-t4 and a CPU verifier host, which checks boundary 0's gradients and boundary 1's activations
VERIFIER_HOST = "  - {name: cpu, region: lab, trust: operator, trusted: true, role: verifier, " \
                "devices: [{type: CPU, count: 1}]}\n"
SOLE_UNTRUSTED = {"hf-llama": 1, "hf-llama-audit": 1}   # shape -> its one untrusted rank: every attack runs there
ATTACK_START, DELAY_START = 20, 30
INVOCATION = ""           # this invocation's command line, recorded in its rows (``main``)
FPR_GOAL = 0.001          # microbatch flags per check (issue 20)
BAN_WITHIN = 10           # steps from the attack's start to the attacker's ban (issue 20)
F1_GOAL = 0.95
EVENTS_KEPT = 40          # flag events kept in a row where a ban went wrong
LR = 1e-3
# The replicated shape's one verifier for both sides of stage 1 costs 4.1x the split placement's step (the linked
# 4-stage shape's, 2.9x: within plan --link-tests-cost 3): the share that keeps its link tests.
LINK_COST_REPLICATED = 5.0
# --quick: the plans of these shapes made (the hand-made one included), one clean run of the first
QUICK = {"shapes": ("split", "replicated", "replicated3"), "steps": 8}


def attack_start(name: str) -> int:
    return DELAY_START if "kind=delay" in ATTACKS[name] else ATTACK_START


def attack_spec(name: str, shape: str) -> str:
    """``name``'s --attack spec on ``shape`` (its start added; the attacker moved to a sole untrusted rank)."""
    rank, rest = ATTACKS[name].split(",", 1)
    if shape in SOLE_UNTRUSTED:
        rank = f"rank={SOLE_UNTRUSTED[shape]}"
    return f"{rank},{rest},start={attack_start(name)}"


def attack_rank(name: str, shape: str) -> int:
    return int(attack_spec(name, shape).split(",")[0].removeprefix("rank="))


def runs_on(name: str, shape: str) -> bool:
    """Whether attack ``name`` applies to ``shape`` (poisoning an all-reduce needs replicas)."""
    return "dir=params" not in ATTACKS[name] or shape in REPLICATED


# ---------------------------------------------------------------------------------------------- plans

def make_plans(shapes: list[str], folder: Path) -> dict[str, Path]:
    """One plan file per shape in ``folder`` (made again each invocation: the plans are part of what is measured)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for shape in shapes:
        path, base = folder / f"{shape}.json", AUDITED.get(shape, shape)
        if base == "copies":
            _replicated(2, copies=folder).save(path)
        elif shape in REPLICATED:
            _replicated(3 if base == "replicated3" else 2).save(path)
        elif base == "hf-llama":
            _hf_llama().save(path)
        else:
            extra = ["--link-tests-cost", "3"] if base == "linked" else []
            proc = subprocess.run([sys.executable, "-m", "planner", "plan", "gpt-tiny", "--cluster", str(CLUSTER),
                                   "--baseline", "uniform", *extra, "-o", str(path)],
                                  check=False, capture_output=True, text=True, env=_env(), timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"stagewise plan ({shape}) failed: {proc.stderr.strip()}")
        out[shape] = path
    return out


def _hf_llama():
    """The tiny HF Llama in 3 stages on the default cluster, its middle stage untrusted and verified."""
    from models.registry import build_model
    from planner.api import make_plan
    from planner.runtime.wire.control import trusted_ranks

    bundle = build_model(HF_SPEC, batch=4, seq=32)
    plan = make_plan(bundle.module, bundle.example_inputs, "default", spec=HF_SPEC, name=bundle.name, stages=3,
                     global_batch=12, microbatch_size=4, time_limit_s=2)
    if not plan.verifiers or plan.stage_ranks(1)[0] in trusted_ranks(plan) or plan.num_ranks != 3:
        raise RuntimeError("the hf-llama plan is not 3 ranks with a verified untrusted middle stage")
    return plan


def _replicated(replicas: int = 2, copies: Path | None = None):
    """gpt-tiny on four-t4 (``replicas`` 2) or five-t4 (3): embed..layers.0 on h0, layers.1..2 replicated on the
    volunteers h1.. (the 16 microbatches shared: 8 and 8, or 6, 5 and 5), layers.3..head on the last host;
    verifiers, pricing and compilation as ``stagewise plan --link-tests-cost 5`` does them. ``copies`` (a folder for
    its cluster file): issue 37's placement instead, four-t4 and a CPU verifier host (rank 4) checking boundary 0's
    gradients and boundary 1's activations, no link test: stage 1 is audited from copies (inputs from h0, the
    gradients h3 sent from h3)."""
    from cost_models.cluster_file import read_cluster_file
    from cost_models.memory import trace_dtype
    from cost_models.precision import resolve_dtype
    from cost_models.training import TrainingConfig
    from planner.check import assert_valid
    from planner.compile import compile_plan
    from planner.model_io import load_chain
    from planner.plan_history import HistoryEntry, utc_stamp
    from planner.plan_values import ModelRef
    from planner.simulate import predict
    from planner.solver.link_tests import keep_link_tests, lost_link_tests
    from planner.solver.objective import Placement, price_program, program_memory
    from planner.solver.policy import VerificationPolicy
    from planner.solver.problem_build import build_problem, scale_chain
    from planner.solver.solution import (
        Solution,
        SolveReport,
        StagePlacement,
        VerifierPlacement,
    )
    from planner.solver.verifiers import assign_verifiers

    _, chain = load_chain("gpt-tiny", batch=1)
    if copies is not None:
        copies.mkdir(parents=True, exist_ok=True)
        (copies / "four-t4-cpu.yaml").write_text(CLUSTER.read_text().replace("name: four-t4", "name: four-t4-cpu")
                                                 .replace("links:", VERIFIER_HOST + "links:"))
    cluster = read_cluster_file(copies / "four-t4-cpu.yaml" if copies is not None else
                                CLUSTER if replicas == 2 else CLUSTER3)
    dtype = resolve_dtype("auto", cluster)
    config = TrainingConfig(global_batch=16, microbatch_size=1, schedule="1f1b", optimizer="adam", dtype=dtype,
                            mixed_precision=dtype != "float32")
    policy = VerificationPolicy(link_test_cost=LINK_COST_REPLICATED)
    scaled = scale_chain(chain, 1)
    problem = build_problem(scaled, cluster, config, policy)
    share = tuple(16 // replicas + (i < 16 % replicas) for i in range(replicas))
    stages = (StagePlacement(index=0, first_block=0, last_block=1, devices=("h0/0",), microbatches=(16,)),
              StagePlacement(index=1, first_block=2, last_block=3,
                             devices=tuple(f"h{i + 1}/0" for i in range(replicas)), microbatches=share),
              StagePlacement(index=2, first_block=4, last_block=5, devices=(f"h{replicas + 1}/0",), microbatches=(16,)))
    if copies is not None:
        verifiers = (VerifierPlacement(boundary=0, device="cpu/0", directions=("grad",)),
                     VerifierPlacement(boundary=1, device="cpu/0", directions=("act",)))
        placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=problem.num_microbatches)
    else:
        verifiers = assign_verifiers(problem, stages, problem.num_microbatches)
        placement = keep_link_tests(problem, Placement(stages=stages, verifiers=verifiers,
                                                       num_microbatches=problem.num_microbatches))
    priced = price_program(problem, placement)
    notes = (f"hand-made: stage 1 replicated on the {replicas} volunteers"
             + (", issue 37's verifier host" if copies is not None else ""),) + lost_link_tests(problem, placement)
    report = SolveReport(method="hand:replicated", status="FEASIBLE", objective_ms=priced.step_ms, bound_ms=None,
                         gap=None, solve_s=0.0, notes=notes)
    solution = Solution(stages=tuple(dataclasses.replace(st, in_flight=n) for st, n in
                                     zip(placement.stages, priced.in_flight)),
                        verifiers=placement.verifiers, num_microbatches=placement.num_microbatches,
                        schedule=config.schedule, predicted_step_ms=priced.step_ms,
                        memory_bytes=program_memory(problem, placement, priced.in_flight), report=report)
    assert_valid(solution, scaled, cluster, config, policy)
    ref = ModelRef(spec="gpt-tiny", name=chain.model_name, fingerprint=chain.fingerprint,
                   batch=chain.microbatch_size, seq=None, dtype=trace_dtype(chain))
    plan = predict(compile_plan(solution, scaled, cluster, config, policy, ref))
    return dataclasses.replace(plan, history=(HistoryEntry(event="planned", when_utc=utc_stamp(),
                                                           reason=f"hand-made replicated shape ({replicas})"),))


# ----------------------------------------------------------------------------------------------- runs

def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "120"}


def run_one(plan: Path, *, shape: str, seed: int, steps: int, attack: str | None, work: Path,
            audit_every: int = AUDIT_EVERY) -> dict[str, Any]:
    """One ``stagewise run`` (``audit_every``: the audited shapes' --audit-every); its row."""
    every = audit_every if shape in AUDITED else 0
    report_path = work / report_name(shape, seed, attack, steps)
    log_path = report_path.with_name(report_path.name.replace(".report.json", ".log"))
    report_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "planner", "run", str(plan), "--steps", str(steps), "--lr", str(LR),
           "--seed", str(seed), "--report", str(report_path),
           "--audit-every", str(every)]
    spec = None
    if attack is not None:
        spec = attack_spec(attack, shape)
        cmd += ["--attack", spec]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_env(),
                              timeout=120 + 8 * steps)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = None, f"timed out after {exc.timeout} s"
    log_path.write_text(output)
    row: dict[str, Any] = {"shape": shape, "model": MODELS.get(shape, "gpt-tiny"), "seed": seed,
                           "attack": attack or "none", "attack_spec": spec, "steps": steps, "exit_code": rc,
                           "duration_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d"),
                           "audit_every": every, "invocation": INVOCATION}
    if not report_path.exists():
        tail = output.strip().splitlines()[-3:]
        return {**row, "error": " | ".join(tail) or "no report"}
    return scored(row, json.loads(report_path.read_text()), json.loads(plan.read_text()))


def report_name(shape: str, seed: int, attack: str | None, steps: int) -> str:
    return f"{shape}-s{seed}-{attack or 'clean'}-{steps}.report.json"


def scored(row: dict[str, Any], report: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """``row`` (what was run, how it exited) with what the run's report says."""
    attack = None if row["attack"] == "none" else row["attack"]
    row = {**row, **summarize(report, plan)}
    if attack is not None:
        row["flag_rate_per_sample"] = row.pop("fpr_per_sample")   # most of an attacked run's flags are true ones
        row.update(attack_metrics(report, row, attack_rank(attack, row["shape"]), attack_start(attack),
                                  plan["config"]["global_batch"] // plan["config"]["microbatch_size"]))
    else:
        row["goal"] = row["fpr_per_sample"] <= FPR_GOAL and not row["banned"] and row["steps_run"] == row["steps"]
    row["ban_events"] = _events_of_interest(report, row, attack)
    return row


def rescore(out: Path, work: Path) -> list[dict[str, Any]]:
    """The rows of ``out`` scored again from the reports and plans kept in ``work`` (no run)."""
    run_keys = ("shape", "seed", "attack", "attack_spec", "steps", "exit_code", "duration_s", "audit_every",
                "invocation")
    rows = []
    for old in json.loads(out.read_text())["rows"]:
        path = work / report_name(old["shape"], old["seed"], None if old["attack"] == "none" else old["attack"],
                                  old["steps"])
        if "error" in old or not path.exists():
            continue
        rows.append(scored({k: old[k] for k in (*run_keys, "model", "date") if k in old}, json.loads(path.read_text()),
                           json.loads((work / f"{old['shape']}.json").read_text())))
    return rows


def summarize(report: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """Counts over every verifier rank: checks (watch-only copies are not checks), flags, drops, blame, bans."""
    watch = {(v["rank"], v["boundary"], d) for v in plan["verifiers"] for d in v.get("watch_only", ())}
    checks = flags_mb = flags_step = tainted = 0
    truncated = False
    for r in report["ranks"]:
        ver = r["verification"]
        for m in ver.get("monitors", ()):
            if (r["rank"], m["boundary"], m["direction"]) in watch:
                continue
            checks += m["checked"]
            flags_mb += m["flagged"]
            flags_step += m["step_flags"]
            tainted += m["tainted"]
        truncated |= ver.get("events_total", 0) > len(ver.get("events", ()))
    blamed = _blamed_steps(report)
    bans = _bans(report)
    return {"steps_run": report["steps"], "checks": checks, "flags_microbatch": flags_mb, "flags_step": flags_step,
            "tainted": tainted, "dropped": sum(report["dropped"]), "flagged_steps": sorted(
                {s for s, n in enumerate(report["dropped"]) if n}),
            "blamed_pairs": sum(len(v) for v in blamed.values()), "blamed_steps": blamed,
            "fpr_per_sample": round(flags_mb / max(1, checks), 6), "banned": report["banned"], "bans": bans,
            **_evidence(report, blamed), "events_truncated": truncated, "final_loss": report["final_loss"],
            "step_ms_median": round(report["measured_step_ms"], 1), **_audits(report)}


def _audits(report: dict[str, Any]) -> dict[str, Any]:
    """The runtime's audits over every verifier rank: run and failed, per sender (none: the keys are absent)."""
    run: dict[str, int] = {}
    failed: dict[str, int] = {}
    for r in _verifier_ranks(report):
        got = r["verification"].get("audits") or {}
        for key, into in (("run_by_sender", run), ("failed_by_sender", failed)):
            for sender, n in got.get(key, {}).items():
                into[sender] = into.get(sender, 0) + n
    if not run:
        return {}
    return {"audits_run": run, "audits_failed": failed}


def _evidence(report: dict[str, Any], blamed: dict[str, list[int]]) -> dict[str, Any]:
    """Per blamed sender: its share of the steps after the warm-up it was blamed in (the ban test assumes an
    honest one at most ``ban_honest_rate``) and the peak of its ban evidence, replayed with the run's ban test,
    against the level at which that CUSUM bans (``BanTest.level``)."""
    from planner.integrity.bans import BanTest

    ranks = _verifier_ranks(report)
    if not ranks:
        return {}
    cfg = ranks[0]["verification"]["config"]
    test = BanTest(honest_rate=cfg["ban_honest_rate"], attack_rate=cfg["ban_attack_rate"],
                   false_steps=cfg["ban_false_steps"], replay_rate=cfg.get("ban_replay_rate"))
    peak: dict[str, float] = {}
    for step in range(report["steps"]):
        test.step({int(k) for k, steps in blamed.items() if step in steps}, at=step)
        for sender, value in test.evidence.items():
            peak[str(sender)] = max(peak.get(str(sender), 0.0), value)
    judged = max(1, report["steps"] - int(cfg["warmup"]))
    return {"blame_rate": {k: round(len(v) / judged, 4) for k, v in blamed.items()},
            "peak_evidence": {k: round(v, 2) for k, v in sorted(peak.items())}, "ban_level": round(test.level, 2)}


def _verifier_ranks(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["ranks"] if r["verification"].get("monitors")]


def _blamed_steps(report: dict[str, Any]) -> dict[str, list[int]]:
    """Sender -> steps it was blamed in (every verifier resolves blame from every verifier's flags: the lowest's)."""
    ranks = _verifier_ranks(report)
    return {k: sorted(v) for k, v in ranks[0]["verification"]["blamed_steps"].items()} if ranks else {}


def _bans(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per banned sender: ban step, first flagged step, evidence (the lowest verifier rank's)."""
    out: dict[int, dict[str, Any]] = {}
    for r in _verifier_ranks(report):
        for e in r["verification"].get("events", ()):
            if e["type"] == "ban" and e["sender"] not in out:
                out[e["sender"]] = {"sender": e["sender"], "step": e["step"],
                                    "first_flagged_step": e["first_flagged_step"], "evidence": e["evidence"]}
    return [out[k] for k in sorted(out)]


def _flag_events(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for r in _verifier_ranks(report) for e in r["verification"].get("events", ()) if e["type"] == "flag"]


def attack_metrics(report: dict[str, Any], row: dict[str, Any], attacker: int, start: int,
                   microbatches: int) -> dict[str, Any]:
    """The attacker's ban against the attack's start; precision/recall/F1 of dropped vs attacked microbatches.

    The dropped microbatches are those of the verifiers' microbatch flags (boundary checks' and audits'). A
    rank reports only its latest events (``planner.integrity.hooks.SUMMARY_EVENTS``): when some flags are missing and the attack corrupted
    every microbatch of every step from its first, a drop is attacked exactly when its step is at or after
    that one, so the report's drops per step give the same counts (``pr_from: counts``)."""
    log = next((r["attacked"] for r in report["ranks"] if r["rank"] == attacker), [])
    attacked = {(s, mb) for s, mb, _, _ in log}
    dropped = {(e["step"], e["mb"]) for e in _flag_events(report) if e["scope"] == "microbatch"}
    first = min((s for s, _ in attacked), default=None)
    if not row["events_truncated"] or len(dropped) == row["flags_microbatch"]:   # audits flag outside monitors
        source, hit, n_dropped = "events", len(attacked & dropped), len(dropped)
    elif first is not None and attacked == {(s, mb) for s in range(first, row["steps_run"])
                                            for mb in range(microbatches)}:
        source, n_dropped = "counts", sum(report["dropped"])
        hit = sum(report["dropped"][first:])
    else:
        source, hit, n_dropped = "unavailable", None, None
    precision = hit / n_dropped if hit is not None and n_dropped else None
    recall = hit / len(attacked) if hit is not None and attacked else None
    f1 = 2 * hit / (len(attacked) + n_dropped) if hit is not None and (attacked or n_dropped) else None
    ban = next((b for b in row["bans"] if b["sender"] == attacker), None)
    honest = [b for b in row["bans"] if b["sender"] != attacker]
    delay = None if ban is None else ban["step"] - start
    return {"attacker": attacker, "attack_start": start, "first_attacked_step": first,
            "attacked_microbatches": len(attacked), "dropped_counted": n_dropped, "pr_from": source,
            "false_drops": None if hit is None else n_dropped - hit,
            "missed_microbatches": None if hit is None else len(attacked) - hit,
            "attacker_ban_step": None if ban is None else ban["step"], "ban_delay_steps": delay,
            "honest_banned": honest, "precision": _r(precision), "recall": _r(recall), "f1": _r(f1),
            "goal": delay is not None and delay <= BAN_WITHIN and not honest,
            "goal_f1": f1 is not None and f1 >= F1_GOAL, **model_metrics(report, row, attacked, dropped, source)}


def model_metrics(report: dict[str, Any], row: dict[str, Any], attacked: set[tuple[int, int]],
                  dropped: set[tuple[int, int]], source: str) -> dict[str, Any]:
    """Precision/recall/F1 of the microbatches kept out of the model against the attacked ones: a ban stops the
    run and its recovery resumes from before the first flagged step (``checkpoint.set_aside``), so every
    microbatch from that step on is undone; those are replayed, so an honest one is lost only if dropped
    before it. Assumes a checkpoint just before that step (a sparser one undoes more: this is the least)."""
    rollback = min((b["first_flagged_step"] for b in row["bans"]), default=row["steps_run"])
    if source == "events":
        hit = sum(1 for s, mb in attacked if s >= rollback or (s, mb) in dropped)
        lost = sum(1 for s, mb in dropped - attacked if s < rollback)
    elif source == "counts":   # every microbatch of every step from the first attacked one is attacked
        first, per_step = min(s for s, _ in attacked), report["dropped"]
        hit = len(attacked) - sum(1 for s, _ in attacked if s < rollback) + sum(per_step[first:rollback])
        lost = sum(per_step[:min(first, rollback)])
    else:
        return {"rollback_step": rollback, "honest_lost": None, "model_precision": None, "model_recall": None, "model_f1": None,
                "goal_model_f1": False}
    precision = hit / (hit + lost) if hit + lost else None
    recall = hit / len(attacked) if attacked else None
    f1 = 2 * hit / (len(attacked) + hit + lost) if attacked or lost else None
    return {"rollback_step": rollback, "honest_lost": lost, "model_precision": _r(precision),
            "model_recall": _r(recall), "model_f1": _r(f1), "goal_model_f1": f1 is not None and f1 >= F1_GOAL}


def _events_of_interest(report: dict[str, Any], row: dict[str, Any], attack: str | None) -> list[dict[str, Any]]:
    """The flag events around what missed the goal, in step order: from an honest ban's first flagged step to it,
    from an attack's start to the attacker's late ban or the run's end, or a clean run's every flag."""
    if row.get("goal"):
        return []
    attacker = attack_rank(attack, row["shape"]) if attack else None
    windows = [(max(0, b["first_flagged_step"] - 1), b["step"]) for b in row["bans"] if b["sender"] != attacker]
    if attacker is not None and (row["ban_delay_steps"] is None or row["ban_delay_steps"] > BAN_WITHIN):
        windows.append((attack_start(attack), row["attacker_ban_step"] or row["steps_run"]))
    if attacker is None and not windows:
        windows.append((0, row["steps_run"]))
    keys = ("step", "mb", "boundary", "direction", "sender", "scope", "reasons", "upstream")
    events = sorted(_flag_events(report), key=lambda e: (e["step"], e["mb"], e["boundary"], e["direction"]))
    return [{k: e[k] for k in keys if k in e} for e in events
            if any(lo <= e["step"] <= hi for lo, hi in windows)][:EVENTS_KEPT]


def pair_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """Precision, recall and F1 over (step, sender) pairs, as ``verification.py`` scores the emulation: the
    attacked pairs are the attacker's steps from its first attacked one to the run's end (a run stops at a
    ban), the predicted ones every (step, sender) the verifiers blamed in the run, before the attack too."""
    first, attacker = row.get("first_attacked_step"), row.get("attacker")
    if first is None or attacker is None:
        return {"pair_precision": None, "pair_recall": None, "pair_f1": None, "goal_pair_f1": False}
    positives = {(s, attacker) for s in range(first, row["steps_run"])}
    predicted = {(s, int(who)) for who, steps in row["blamed_steps"].items() for s in steps}
    hit = len(positives & predicted)
    precision = hit / len(predicted) if predicted else None
    recall = hit / len(positives) if positives else None
    f1 = 2 * hit / (len(positives) + len(predicted)) if positives or predicted else None
    return {"pair_precision": _r(precision), "pair_recall": _r(recall), "pair_f1": _r(f1),
            "goal_pair_f1": f1 is not None and f1 >= F1_GOAL}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ------------------------------------------------------------------------------------------- reporting

def print_row(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['shape']:<10} {row['seed']:>4} {row['attack']:<10} ERROR exit {row['exit_code']}: {row['error']}",
              flush=True)
        return
    bans = ",".join(f"{b['sender']}@{b['step']}" for b in row["bans"]) or "-"
    fpr = f"{100 * row['fpr_per_sample']:.3f}" if row["attack"] == "none" else "-"
    text = (f"{row['shape']:<10} {row['seed']:>4} {row['attack']:<10} {row['steps_run']:>4}/{row['steps']:<4} "
            f"{row['checks']:>6} {row['flags_microbatch']:>5} {row['flags_step']:>5} {row['dropped']:>5} "
            f"{fpr:>7} {bans:>12}")
    if row["attack"] != "none":
        delay = "-" if row["ban_delay_steps"] is None else f"+{row['ban_delay_steps']}"
        f = "  ".join("-" if row.get(k) is None else f"{row[k]:.2f}"
                      for k in ("precision", "recall", "f1", "model_f1"))
        text += f" {delay:>6} {f}"
    print(text + f"  {'ok' if row['goal'] else 'MISSED'}  {row['duration_s']:.0f} s", flush=True)


HEADER = (f"{'shape':<10} {'seed':>4} {'attack':<10} {'steps':>9} {'checks':>6} {'flagM':>5} {'flagS':>5} "
          f"{'drop':>5} {'fpr%':>7} {'bans r@step':>12} {'ban-st':>6} P     R     F1    modelF1")


def plan_summary(path: Path) -> dict[str, Any]:
    """What a shape's plan is: each stage's blocks and ranks, the verifiers, the notes, the predicted step."""
    plan = json.loads(path.read_text())
    ranks = {}
    for r in plan["ranks"]:
        ranks.setdefault(r["stage"], []).append(f"{r['rank']}:{r['host']}")
    return {"stages": [{"blocks": [b["name"] for b in st["blocks"]], "ranks": ranks.get(st["index"], [])}
                       for st in plan["stages"]],
            "verifiers": plan["verifiers"], "notes": plan["report"].get("notes", []),
            "method": plan["report"]["method"], "predicted_step_ms": round(plan["predicted"]["step_ms"], 2)}


def merge(out: Path, rows: list[dict[str, Any]], plans: dict[str, Path]) -> None:
    """Rows merged into ``out`` by (shape, seed, attack, date), with the shapes' plans; a summary of the latest row
    of each (shape, seed, attack) there (rows of earlier code are kept with their dates; undated: before 2026-12-05)."""
    import torch

    data = json.loads(out.read_text()) if out.exists() else {"rows": []}
    data["plans"] = {**data.get("plans", {}), **{shape: plan_summary(p) for shape, p in plans.items()}}
    new = {_key(r) for r in rows}
    data["rows"] = sorted([r for r in data["rows"] if _key(r) not in new] + rows,
                          key=lambda r: (r["attack"] != "none", r["attack"], SHAPES.index(r["shape"]), r["seed"],
                                         r.get("date") or ""))
    latest = {_key(r)[:3]: r for r in data["rows"]}   # sorted by date last: the newest of each wins
    ok = [r for r in latest.values() if "error" not in r]
    clean = [r for r in ok if r["attack"] == "none"]
    attacks = [r for r in ok if r["attack"] != "none"]
    for r in attacks:
        r.update(pair_metrics(r))
    data["summary"] = {
        "clean_runs": len(clean), "clean_checks": sum(r["checks"] for r in clean),
        "clean_flags_microbatch": sum(r["flags_microbatch"] for r in clean),
        "clean_fpr_per_sample": _r(sum(r["flags_microbatch"] for r in clean) / max(1, sum(r["checks"] for r in clean))),
        "clean_runs_with_bans": [(r["shape"], r["seed"]) for r in clean if r["banned"]],
        "clean_goal_met": sum(r["goal"] for r in clean),
        "attack_runs": len(attacks), "attack_goal_met": sum(r["goal"] for r in attacks),
        "attack_f1_goal_met": sum(r["goal_f1"] for r in attacks),
        "attack_pair_f1_goal_met": sum(r["goal_pair_f1"] for r in attacks),
        "attack_runs_model_scored": sum("goal_model_f1" in r for r in attacks),
        "attack_model_f1_goal_met": sum(r.get("goal_model_f1", False) for r in attacks),
        "attacks_missed": [(r["shape"], r["seed"], r["attack"]) for r in attacks if not r["goal"]],
        "errors": [(r["shape"], r["seed"], r["attack"]) for r in latest.values() if "error" in r]}
    data["setup"] = {"cluster": str(CLUSTER.relative_to(ROOT)), "cluster_replicated3": str(CLUSTER3.relative_to(ROOT)),
                     "model": "gpt-tiny", "models": {**MODELS, "hf-llama-tiny": HF_SPEC}, "lr": LR,
                     "attack_start": ATTACK_START, "delay_start": DELAY_START, "ban_within": BAN_WITHIN,
                     "fpr_goal": FPR_GOAL, "attacks": ATTACKS}
    data["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out)


def _key(row: dict[str, Any]) -> tuple[str, int, str, str]:
    return row["shape"], row["seed"], row["attack"], row.get("date") or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), help="clean-run shapes")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 3], help="clean-run seeds")
    parser.add_argument("--steps", type=int, default=200, help="steps of a clean run")
    parser.add_argument("--attacks", nargs="+", choices=[*ATTACKS, "none"], default=list(ATTACKS),
                        help="attacks to run ('none': no attack runs)")
    parser.add_argument("--attack-shapes", nargs="+", choices=SHAPES, default=list(ATTACK_SHAPES))
    parser.add_argument("--attack-steps", type=int, default=60)
    parser.add_argument("--attack-seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--no-clean", action="store_true", help="attack runs only")
    parser.add_argument("--audit-every", type=int, default=AUDIT_EVERY,
                        help=f"--audit-every of the audited shapes (default {AUDIT_EVERY}; rows record it)")
    parser.add_argument("--work", help="folder for the plans, reports and logs (default: a temporary one)")
    parser.add_argument("--out", default=None, help="the JSON rows are merged into (default benchmarks/results/"
                                                    "verification_dist.json; --quick: one in its temporary folder)")
    parser.add_argument("--rescore", action="store_true",
                        help="run nothing: score the rows of --out again from the reports kept in --work")
    parser.add_argument("--quick", action="store_true", help="a smoke run (see above); writes nothing outside its "
                        "temporary folder unless --out or --work")
    args = parser.parse_args(argv)
    global INVOCATION
    INVOCATION = " ".join(["python benchmarks/verification_dist.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="verification_dist-") as tmp:
            return quick(Path(args.work or tmp), Path(args.out) if args.out else Path(tmp) / "verification_dist.json")
    args.out = args.out or str(RESULTS)
    if args.rescore:
        if not args.work:
            parser.error("--rescore needs --work (the folder of an earlier invocation)")
        rows = rescore(Path(args.out), Path(args.work))
        print(HEADER)
        for row in rows:
            print_row(row)
        merge(Path(args.out), rows, {shape: Path(args.work) / f"{shape}.json" for shape in SHAPES
                                     if (Path(args.work) / f"{shape}.json").exists()})
        print(json.dumps(json.loads(Path(args.out).read_text())["summary"]))
        return 0
    attacks = [a for a in args.attacks if a != "none"]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="verification_dist-"))
    clean_shapes = [] if args.no_clean else args.shapes
    plans = make_plans(sorted(set(clean_shapes) | (set(args.attack_shapes) if attacks else set()),
                              key=SHAPES.index), work)
    print(f"plans and logs in {work}\n{HEADER}", flush=True)
    runs = [(s, seed, None, args.steps) for s in clean_shapes for seed in args.seeds] + \
           [(s, seed, a, args.attack_steps) for seed in args.attack_seeds for a in attacks for s in args.attack_shapes
            if runs_on(a, s)]
    for shape, seed, attack, steps in runs:
        row = run_one(plans[shape], shape=shape, seed=seed, steps=steps, attack=attack, work=work,
                      audit_every=args.audit_every)
        print_row(row)
        merge(Path(args.out), [row], {shape: plans[shape]})
    print(json.dumps(json.loads(Path(args.out).read_text())["summary"]))
    return 0


def quick(work: Path, out: Path) -> int:
    """Make the plans of ``QUICK["shapes"]``, run the first shape clean for a few steps, merge its row into ``out``."""
    plans = make_plans(list(QUICK["shapes"]), work)
    shape = QUICK["shapes"][0]
    print(HEADER, flush=True)
    row = run_one(plans[shape], shape=shape, seed=0, steps=QUICK["steps"], attack=None, work=work)
    print_row(row)
    merge(out, [row], plans)
    print(json.dumps(json.loads(out.read_text())["summary"]))
    return 1 if "error" in row else 0


if __name__ == "__main__":
    sys.exit(main())
