"""Which of the plan's ranks a process runs, and how it joins the others: the plan decides, not the launcher.

Under torchrun, c10d's rendezvous orders nodes by their names and ignores ``--node-rank``, so
torchrun's global ``RANK`` says nothing about the machine a process runs on: taken as the plan's
rank, it could hand an untrusted host a trusted stage or verifier. So the operator names each host
when starting it (``--host NAME`` or ``STAGEWISE_HOST``, the host's name in the plan's cluster);
that host's ranks in the plan, in rank order, go to its processes by local rank (``LOCAL_RANK``,
0 .. nproc-1). A host the plan does not have, or a process count other than the host's rank count,
is refused, named. A plan with a single host needs no name.

The process group is initialised with the plan's rank. Its store is the one torchrun's ``env://``
gives (a client of torchrun's agent store, or where torchrun shares none, one hosted by torchrun's
rank 0, whose place torchrun's ``RANK`` says); before the group forms, every process claims its
plan rank in that store, so two processes given one host name are refused instead of hanging.

Without torchrun (``--store ADDR:PORT``), the operator starts one process per rank of each host
(``LOCAL_RANK=i`` for the i-th), and the plan's rank 0 serves the run's own store on ADDR alone:
nothing in it is ever unpickled (c10d's dynamic rendezvous, torchrun's ``--rdzv-backend c10d``,
unpickles what its store holds), and a stranger who writes into it cannot pass the membership proof.

The local launcher (``stagewise run``, ``STAGEWISE_LOCAL_RUN=1``) runs every rank on this machine:
its ``RANK`` is the plan's rank, rank 0 hosts the store on a loopback socket and gloo binds the
loopback interface, so nothing of the run listens beyond this machine.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from planner.errors import InvalidInputError
from planner.runtime.wire import comm

HOST_ENV = "STAGEWISE_HOST"
LOCAL_RUN_ENV = "STAGEWISE_LOCAL_RUN"


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """This process's place in the plan."""

    rank: int           # the plan's rank, which the process group uses too
    host: str           # its host in the plan
    local: bool         # every rank runs on this machine (the local launcher)


def local_run_env() -> dict[str, str]:
    """What the local launcher sets for its ranks."""
    return {LOCAL_RUN_ENV: "1"}


def plan_hosts(plan) -> tuple[str, ...]:
    """The plan's hosts that run ranks, in order of their first rank."""
    return tuple(dict.fromkeys(info.host for info in plan.ranks))


def host_ranks(plan, host: str) -> tuple[int, ...]:
    """The plan's ranks on ``host``, in rank order (local rank i runs the i-th)."""
    return tuple(info.rank for info in plan.ranks if info.host == host)


def place(plan, *, host: str | None, launcher_rank: int, local_rank: int,
          environ: Mapping[str, str] = os.environ, elastic: bool = False) -> Placement | None:
    """This process's plan rank: the launcher's rank under the local launcher, else the ``local_rank``-th
    of the ranks the plan gives the named host (``host``, else ``$STAGEWISE_HOST``). ``elastic``: a host
    may have more processes than ranks (the plan changes from start to start): those beyond get None."""
    if environ.get(LOCAL_RUN_ENV) == "1":
        return Placement(rank=launcher_rank, host=plan.ranks[launcher_rank].host, local=True)
    hosts = plan_hosts(plan)
    host = host or environ.get(HOST_ENV) or None
    if host is None:
        if len(hosts) != 1:
            raise InvalidInputError("this host's name", expected=f"--host NAME or {HOST_ENV}=NAME, NAME one of the "
                                    f"plan's hosts ({', '.join(hosts)})", found="none",
                                    fix="start each host's torchrun with its own name from the plan: "
                                        "... -m planner.runtime PLAN --host NAME (torchrun's node order is not "
                                        "the plan's)")
        host = hosts[0]
    ranks = host_ranks(plan, host)
    if elastic and local_rank >= len(ranks):
        return None
    if not ranks:
        raise InvalidInputError(f"host {host!r}", expected=f"one of the plan's hosts ({', '.join(hosts)})",
                                found="a host the plan gives no rank", fix="check --host / $STAGEWISE_HOST")
    nproc = environ.get("LOCAL_WORLD_SIZE")  # torchrun's --nproc-per-node
    if (nproc is not None and nproc != str(len(ranks)) and not elastic) or not 0 <= local_rank < len(ranks):
        raise InvalidInputError(f"host {host!r} runs ranks {list(ranks)} of the plan",
                                expected=f"{len(ranks)} processes on it (--nproc-per-node {len(ranks)})",
                                found=f"{nproc} (local rank {local_rank})" if nproc else f"local rank {local_rank}",
                                fix=f"start torchrun on {host} with --nproc-per-node {len(ranks)}")
    return Placement(rank=ranks[local_rank], host=host, local=False)


def claim(store: dist.Store, placement: Placement) -> None:
    """Take this process's plan rank in the store; a second claim of it is refused, naming the host."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's restarts meet afresh
    taken = store.add(f"stagewise/claim/{attempt}/{placement.rank}", 1)
    if taken != 1:
        raise InvalidInputError(f"rank {placement.rank} of the plan (host {placement.host!r}) is taken by another "
                                "process", expected="each host started once, under its own name",
                                found=f"{taken} processes claiming it",
                                fix="check the --host / $STAGEWISE_HOST each host was started with")


def join(placement: Placement, *, backend: str, launcher_rank: int, world_size: int, timeout_s: float,
         launcher_world_size: int | None = None, store_at: tuple[str, int] | None = None) -> None:
    """Form the default process group with the plan's ranks (see the module docstring).
    ``launcher_world_size``: torchrun's process count, where it differs from the plan's (elastic starts).
    ``store_at``: the run's own store (``--store ADDR:PORT``), served by the plan's rank 0, instead of
    torchrun's."""
    if store_at is not None:
        print(f"stagewise: host {placement.host!r} runs the plan's rank {placement.rank}", file=sys.stderr, flush=True)
        store = comm.bound_store(rank=placement.rank, world_size=world_size, addr=store_at[0], port=store_at[1],
                                 timeout_s=timeout_s)
    elif placement.local:
        comm.keep_gloo_on_loopback()
        port = os.environ.get("MASTER_PORT", "")
        if not port.isdigit():
            raise InvalidInputError("MASTER_PORT", expected="the store's port (set by `stagewise run`)",
                                    found=repr(port))
        store = comm.loopback_store(rank=placement.rank, world_size=world_size, port=int(port), timeout_s=timeout_s)
    else:
        print(f"stagewise: host {placement.host!r}: launcher rank {launcher_rank} runs the plan's rank "
              f"{placement.rank}", file=sys.stderr, flush=True)  # the operator sees the layout taken
        store = comm.env_store(launcher_rank=launcher_rank, world_size=launcher_world_size or world_size,
                               timeout_s=timeout_s)
    claim(store, placement)
    comm.init_process_group(backend=backend, rank=placement.rank, world_size=world_size, timeout_s=timeout_s,
                            store=store)
