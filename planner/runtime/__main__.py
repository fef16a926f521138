"""``torchrun ... -m planner.runtime PLAN --steps N``: one rank of a plan under torchrun.

Example, two "hosts" on one machine (run each line in its own shell)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job1 -m planner.runtime plan.json --steps 5
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job1 -m planner.runtime plan.json --steps 5

Rank 0 prints one line per step and predicted vs measured step time at the end.
"""
import sys

from planner.runtime.worker import main

sys.exit(main())
