"""``torchrun ... -m planner.runtime PLAN --host NAME --steps N``: one rank of a plan under torchrun.

Each host is started with its own name in the plan's cluster (``--host NAME`` or
``STAGEWISE_HOST=NAME``; a plan with one host needs none) and ``--nproc-per-node`` equal to the
number of ranks the plan gives that host. Its processes run those ranks, in rank order by
``LOCAL_RANK``: c10d's rendezvous orders nodes by address and ignores ``--node-rank``, so
torchrun's own ``RANK`` only finds the store (``planner/runtime/launcher/hosts.py``). A host name the plan
does not have, a process count that differs, or a name given to two hosts is refused, named.

Every host holds the run secret the plan was signed with (``--secret-file`` or
``STAGEWISE_SECRET``: copy one secret file to each invited host). ``PYTHONSAFEPATH=1`` keeps the
current folder off the ranks' import path.

Example, two "hosts" of a plan with hosts ``h0`` and ``h1`` on one machine (each line in its own shell)::

    PYTHONSAFEPATH=1 torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job1 -m planner.runtime plan.json --host h0 --steps 5
    PYTHONSAFEPATH=1 torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job1 -m planner.runtime plan.json --host h1 --steps 5

The plan's rank 0 prints one line per step and predicted vs measured step time at the end; every
process says which plan rank it runs (on stderr).

c10d's dynamic rendezvous unpickles what its store holds, and the store listens on every interface
with no credential (SECURITY.md): on a network others reach, start each rank without torchrun, with
the run's own store, which the host of the plan's rank 0 serves on the address given, alone::

    LOCAL_RANK=0 PYTHONSAFEPATH=1 python -m planner.runtime plan.json --host h0 --store 10.0.0.5:29500 --steps 5
    LOCAL_RANK=0 PYTHONSAFEPATH=1 python -m planner.runtime plan.json --host h1 --store 10.0.0.5:29500 --steps 5

Elastic (hosts that fail or join; ``planner/runtime/launcher/torchrun_elastic.py``): start every host with
``--nnodes MIN:MAX --max-restarts N``, ``--nproc-per-node`` its device count, and ``--elastic
--checkpoint-dir DIR`` on storage every host reaches; the host that serves the rendezvous endpoint
(``--rdzv-conf is_host=1``) must outlive the run. When a host is lost or joins, torchrun restarts the
workers; at each start they agree on the hosts present, torchrun's rank 0 re-plans if the plan needs
a host that is gone (or one it excluded is back, or a new one a signed join request describes), signs
the plan and writes ``DIR/plan-elastic-<start>.json``, and every rank resumes from the newest complete
checkpoint::

    PYTHONSAFEPATH=1 torchrun --nnodes 1:2 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job1 --rdzv-conf is_host=1 \
        -m planner.runtime plan.json --host h0 --steps 500 --elastic --checkpoint-dir /shared/ckpt
"""
import sys

from planner.runtime.launcher.worker import main

sys.exit(main())
