"""``replan``: a plan for the same model and training on its cluster less lost, banned or excluded hosts (or with
hosts re-admitted or joining), warm-started from the old plan, its history and reason kept."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from cost_models.cluster_file import parse_cluster
from planner.api import plan_chain
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.plan_history import HistoryEntry, utc_stamp
from planner.solver.warm import WarmStage, WarmStart


def replan(plan: Any, *, exclude_hosts: Sequence[str] = (), exclude_domains: Sequence[str] = (),
           readmit_hosts: Sequence[str] = (), add_hosts: Sequence[Mapping[str, Any]] = (), reason: str,
           event: str | None = None, time_limit_s: float = 30.0, workers: int = 2, progress: Any = None,
           warm: bool = True) -> Any:
    """A new plan for ``plan``'s model and training on its cluster less some machines: hosts that were
    lost, whole trust domains (a banned worker's, when the policy excludes its domain), and the hosts
    excluded before, less those re-admitted (``readmit_hosts``: excluded by mistake, or back to join a
    run), plus ``add_hosts``: hosts new to the cluster (in the cluster file's shape), which join it.

    The re-plan has a first plan's time limit (the same standard; its baselines take their reserve of it),
    warm-started from the old plan: its microbatch size and its stages repaired to the devices left (``planner.solver.warm``).
    ``warm=False``: a cold solve over every microbatch size, as a fresh plan (at 176 devices the search's
    setup alone, per microbatch size, outlasts a 10 s limit: benchmarks/warm_replan.py).
    The new plan keeps the model, batch, optimizer, precision, policy and verifier settings and the full
    cluster (with the added hosts); its ``excluded_hosts`` say what it leaves out, its history gains an
    entry (``event``: ``failure``, ``ban``, ``manual``, ``readmit`` or ``join``; default ``join`` when adding
    hosts and excluding none, ``readmit`` when only re-admitting, else ``failure``) and its report's first
    note says what changed and why. Its checkpoints are the old plan's (keyed by parameter name, so
    ``stagewise run NEW --resume`` re-shards them onto the new stages).
    """
    added = [h.get("name") if isinstance(h, Mapping) else None for h in add_hosts]
    gone, back = _host_changes(plan, exclude_hosts, exclude_domains, readmit_hosts, added)
    event = event or ("join" if added and not gone else "readmit" if back and not gone else "failure")
    entry = HistoryEntry(event=event, when_utc=utc_stamp(), reason=reason, excluded_hosts=tuple(sorted(gone)),
                         excluded_domains=tuple(sorted(set(exclude_domains))), readmitted_hosts=tuple(sorted(back)),
                         previous_ranks=plan.num_ranks, previous_step_ms=plan.predicted.step_ms)
    excluded = tuple(sorted((set(plan.excluded_hosts) | gone) - back))
    cluster = parse_cluster({**plan.cluster, "hosts": [*plan.cluster["hosts"], *add_hosts]})  # checks the new ones
    full = {**plan.cluster, "hosts": [*plan.cluster["hosts"], *(cluster.host(n).to_dict() for n in added)]}
    if len(excluded) == len(cluster.hosts):
        raise InfeasiblePlanError("every host of the cluster is excluded", fix="exclude fewer hosts")
    new = plan_chain(plan.chain(), cluster.without_hosts(set(excluded)), spec=plan.model.spec, seq=plan.model.seq,
                     schedule=plan.config.schedule, global_batch=plan.config.global_batch, policy=plan.policy,
                     microbatch_size=plan.config.microbatch_size if warm else None,
                     time_limit_s=time_limit_s, optimizer=plan.config.optimizer, dtype=plan.config.dtype,
                     workers=workers, progress=progress, warm_start=warm_start_of(plan) if warm else None,
                     model=plan.model)
    changes = ([f"without {', '.join(sorted(gone))}"] if gone else []) + \
        ([f"with {', '.join(sorted(back))} {'joined' if event == 'join' else 're-admitted'}"] if back else [])
    note = (f"replanned {' and '.join(changes)}: {reason} (the previous plan: {plan.num_ranks} ranks, "
            f"simulated step {plan.predicted.step_ms:.3f} ms)")
    report = dataclasses.replace(new.report, notes=(note, *new.report.notes))
    return dataclasses.replace(new, report=report, verifier_config=plan.verifier_config, cluster=full,
                               excluded_hosts=excluded, history=(*plan.history, entry),
                               cluster_source=plan.cluster_source)


def _host_changes(plan: Any, exclude_hosts: Sequence[str], exclude_domains: Sequence[str],
                  readmit_hosts: Sequence[str], add_hosts: Sequence[Any] = ()) -> tuple[set[str], set[str]]:
    """(hosts newly excluded, hosts re-admitted or added), every name checked against the plan's full cluster
    (``add_hosts``: the names of hosts new to it)."""
    cluster = parse_cluster(plan.cluster)
    names = {h.name for h in cluster.hosts}
    for host in add_hosts:
        if host in names or list(add_hosts).count(host) > 1:
            raise InvalidInputError(f"add host {host!r}", expected="a host new to the plan's cluster, named once",
                                    found="in the cluster already" if host in names else "named twice",
                                    fix="re-admit a host of the cluster by name instead of describing it")
    domains = {h.trust for h in cluster.hosts}
    for what, asked, known in (("exclude host", exclude_hosts, names), ("exclude trust domain", exclude_domains,
                                                                       domains), ("readmit host", readmit_hosts, names)):
        unknown = sorted(set(asked) - known)
        if unknown:
            raise InvalidInputError(f"{what} {unknown[0]!r}", expected=f"one of {', '.join(sorted(known))}",
                                    fix="name a host (or trust domain) of the plan's cluster")
    already = set(plan.excluded_hosts)
    for host in exclude_hosts:
        if host in already:
            raise InvalidInputError(f"exclude host {host!r}", expected="a host the plan still runs on",
                                    found="excluded already", fix="drop it from --exclude")
    for host in readmit_hosts:
        if host not in already:
            raise InvalidInputError(f"readmit host {host!r}", expected="a host the plan excludes (" +
                                    (", ".join(sorted(already)) or "none") + ")", found="not excluded",
                                    fix="re-admit only a host excluded earlier (see `stagewise show PLAN`)")
    both = set(readmit_hosts) & ({*exclude_hosts} | {h.name for h in cluster.hosts if h.trust in exclude_domains})
    if both:
        raise InvalidInputError(f"host {min(both)!r}", expected="excluded or re-admitted",
                                found="both", fix="name it once")
    gone = {h.name for h in cluster.hosts if h.name in exclude_hosts or h.trust in exclude_domains} - already
    if not gone and not readmit_hosts and not add_hosts:
        raise InvalidInputError("replan", expected="at least one host or trust domain to exclude, or a host to "
                                "re-admit", found="none", fix="pass --exclude HOST, --exclude-domain TRUST or "
                                "--readmit HOST")
    return gone, set(readmit_hosts) | set(add_hosts)


def warm_start_of(plan: Any) -> WarmStart:
    """``plan``'s stage partition and placement, for the solver to start a re-plan from."""
    return WarmStart(stages=tuple(
        WarmStage(first_block=st.first_block, last_block=st.last_block,
                  devices=tuple(plan.ranks[r].device for r in plan.stage_ranks(st.index)),
                  shares=tuple(len(plan.ranks[r].microbatches) for r in plan.stage_ranks(st.index)))
        for st in plan.stages))
