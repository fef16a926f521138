"""Under torchrun's elastic rendezvous, each (re)start runs the plan for the hosts that are there.

``torchrun --nnodes MIN:MAX --max-restarts N ... -m planner.runtime PLAN --host NAME --elastic
--checkpoint-dir SHARED``: torchrun restarts every worker when one fails (a lost host takes its workers
with it, and the others' next message to it fails) and when a host joins. At each start the workers
agree on the plan before anything of it runs:

1. every process writes its host's name and process count (``LOCAL_WORLD_SIZE``) into torchrun's
   store under this start's number (``TORCHELASTIC_RESTART_COUNT``), and waits for all of them;
2. torchrun's rank 0 takes the newest plan (the last one an elastic start wrote into the checkpoint
   folder, else ``PLAN``); if a host it uses is missing or has fewer processes than its ranks, or a
   host it excludes is back, or a host new to the cluster is there with a signed join request
   describing it (``stagewise join PLAN --describe HOST.yaml --checkpoint-dir SHARED``), it re-plans
   (``planner.replan.replan``: the old plan's history and microbatch size, warm-started, the reason
   recorded), signs the new plan with the run secret and writes it to
   ``SHARED/plan-elastic-<start>.json``; then it names the plan in the store. A host neither in the
   cluster nor described so stops the start, named;
3. every process reads that plan and checks its signature (a plan no member signed is refused), and
   the run resumes from the newest complete checkpoint when there is one (re-sharded by parameter
   name onto the new stages). A host's processes beyond the plan's ranks on it exit at once (0).

So each host is started with ``--nproc-per-node`` at least the ranks any plan may give it (its device
count in the cluster file; one more on a host that may carry a CPU verifier), and the checkpoint folder
is one every host reaches (a shared file system). The host that serves the rendezvous endpoint must
outlive the run (torchrun's c10d store lives there). Work since the newest checkpoint is done again.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from planner.replan import replan
from planner.errors import InvalidInputError
from planner.runtime.launcher.hosts import HOST_ENV, host_ranks, plan_hosts
from planner.runtime.launcher.membership import load_signed_plan, operator_trust
from planner.runtime.options import RunOptions
from planner.runtime.recovery import checkpoint, joins
from planner.runtime.wire import comm

PREFIX = "stagewise/elastic"
PLAN_GLOB = "plan-elastic-*.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticStart:
    """What this start runs: the plan's path and whether it resumes from a checkpoint."""

    plan: str
    resume: bool


def agree(opts: RunOptions, *, launcher_rank: int, world_size: int, key: bytes,
          store: dist.Store | None = None, start: str | None = None) -> ElasticStart:
    """The plan every worker of this start runs (see the module docstring)."""
    if opts.checkpoint_dir is None:
        raise InvalidInputError("--elastic", expected="--checkpoint-dir DIR (on storage every host reaches)",
                                found="no checkpoint folder", fix="add --checkpoint-dir SHARED/DIR")
    start = start if start is not None else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = store or comm.env_store(launcher_rank=launcher_rank, world_size=world_size, timeout_s=opts.timeout_s)
    prefix = f"{PREFIX}/{start}"
    host = opts.host or os.environ.get(HOST_ENV)
    if not host:
        raise InvalidInputError("this host's name", expected=f"--host NAME or {HOST_ENV}=NAME", found="none",
                                fix="start each host's torchrun with its own name from the plan's cluster")
    slots = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    store.set(f"{prefix}/host/{launcher_rank}", json.dumps({"host": host, "slots": slots}))
    present = _present(store, prefix, world_size, opts.timeout_s)
    if launcher_rank == 0:
        store.set(f"{prefix}/plan", _decide(opts, key, present, start))
    store.wait([f"{prefix}/plan"], timedelta(seconds=opts.timeout_s + opts.replan_time_limit_s * 3))
    path = store.get(f"{prefix}/plan").decode()
    return ElasticStart(plan=path, resume=bool(checkpoint.complete_steps(opts.checkpoint_dir)))


def _present(store: dist.Store, prefix: str, world_size: int, timeout_s: float) -> dict[str, int]:
    """Host -> its process count, from every worker's entry (data only: checked, never executed)."""
    keys = [f"{prefix}/host/{r}" for r in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    present: dict[str, int] = {}
    for k in keys:
        entry = json.loads(store.get(k).decode())
        if not (isinstance(entry, dict) and isinstance(entry.get("host"), str) and isinstance(entry.get("slots"), int)):
            raise InvalidInputError(f"elastic entry {k}", expected='{"host": NAME, "slots": N}', found=repr(entry))
        present[entry["host"]] = max(present.get(entry["host"], 0), entry["slots"])
    return present


def newest_plan(opts: RunOptions) -> str:
    """The plan the last elastic start wrote, else the run's first plan."""
    written = sorted(Path(opts.checkpoint_dir).glob(PLAN_GLOB), key=lambda p: int(p.stem.rsplit("-", 1)[1])) \
        if opts.checkpoint_dir and Path(opts.checkpoint_dir).is_dir() else []
    return str(written[-1]) if written else os.fspath(opts.plan)


def _decide(opts: RunOptions, key: bytes, present: dict[str, int], start: str) -> str:
    """The newest plan if the hosts present can run it, else a re-plan for them (signed, written)."""
    path = newest_plan(opts)
    plan, _ = load_signed_plan(path, key, operator=operator_trust(opts))
    known = {h.name for h in plan.effective_cluster().hosts} | set(plan.excluded_hosts)
    strangers = sorted(set(present) - known)
    added = _described(opts, key, plan, strangers)
    unknown = [h for h in strangers if h not in added]
    if unknown:
        raise InvalidInputError(f"host {unknown[0]!r}", expected=f"a host of the plan's cluster "
                                f"({', '.join(sorted(known))}) or one a signed join request describes",
                                found="a stranger", fix="describe it: stagewise join PLAN --describe HOST.yaml "
                                f"--checkpoint-dir {opts.checkpoint_dir}")
    lost = sorted(h for h in plan_hosts(plan) if present.get(h, 0) < len(host_ranks(plan, h)))
    back = sorted(h for h in plan.excluded_hosts if h in present)
    if not lost and not back and not added:
        return path
    reason = f"elastic start {start}: " + ", ".join([f"{h} gone or short of processes" for h in lost]
                                                     + [f"{h} back" for h in back] + [f"{h} joined" for h in added])
    new = replan(plan, exclude_hosts=lost, readmit_hosts=back, add_hosts=list(added.values()), reason=reason,
                 event="failure" if lost else "join" if added else "readmit", time_limit_s=opts.replan_time_limit_s)
    short = sorted(h for h in plan_hosts(new) if present.get(h, 0) < len(host_ranks(new, h)))
    if short:
        raise InvalidInputError(f"host {short[0]!r}", expected=f"{len(host_ranks(new, short[0]))} processes for "
                                "the re-plan's ranks on it", found=f"{present[short[0]]}",
                                fix="start each host with --nproc-per-node of its device count (+1 for a verifier)")
    out = Path(opts.checkpoint_dir) / f"plan-elastic-{start}.json"
    new.save(out, secret=key)
    return str(out)


def _described(opts: RunOptions, key: bytes, plan, strangers: list[str]) -> dict[str, dict]:
    """Host -> its description, for each of ``strangers`` a signed, valid join request in the checkpoint
    folder's join folder describes (requests that do not apply are left to the local launcher's rules)."""
    out: dict[str, dict] = {}
    for path in joins.pending(Path(opts.checkpoint_dir) / joins.FOLDER):
        try:
            request = joins.read_request(path, key)
            joins.check_request(plan, request)
        except InvalidInputError:
            continue
        if request.new_host is not None and request.host in strangers:
            out[request.host] = dict(request.new_host)
    return out
