"""The auditor's copy stepper on idle CPU time (issue 37, ``planner.runtime.rank.audit_background``): its thread
runs at the idle scheduling class, back at the normal one while the run's thread waits on it, and a copy's
``settle`` waits that way; on a GPU it keeps the normal class."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from planner.runtime.rank import audit_copy
from planner.runtime.rank.audit_background import Background

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="the idle scheduling class is Linux's")


def _class_of(pool: ThreadPoolExecutor) -> int:
    return pool.submit(os.sched_getscheduler, 0).result()


def test_the_stepper_runs_idle_but_while_waited_on():
    background = Background(torch.device("cpu"))
    with ThreadPoolExecutor(max_workers=1, initializer=background.start) as pool:
        assert _class_of(pool) == os.SCHED_IDLE and background.idle
        release, seen = threading.Event(), []

        def work() -> None:
            release.wait()
            seen.append(os.sched_getscheduler(0))

        job = pool.submit(work)
        with background.urgent():
            release.set()
            job.result()
        assert seen == [os.SCHED_OTHER]
        assert _class_of(pool) == os.SCHED_IDLE   # idle again once the wait is over


def test_a_copys_settle_waits_for_its_step_at_the_normal_class():
    background = Background(torch.device("cpu"))
    with ThreadPoolExecutor(max_workers=1, initializer=background.start) as pool:
        copy = audit_copy.StageCopy(runtime=_Runtime(), optimizer=None, stepper=pool, background=background)
        release, seen = threading.Event(), []

        def step() -> None:
            release.wait()
            seen.append(os.sched_getscheduler(0))

        copy.pending = pool.submit(step)
        threading.Timer(0.2, release.set).start()
        copy.settle()
        assert seen == [os.SCHED_OTHER] and copy.pending is None


def test_on_a_gpu_the_stepper_keeps_the_normal_class():
    background = Background(torch.device("cuda", 0))
    with ThreadPoolExecutor(max_workers=1, initializer=background.start) as pool:
        assert _class_of(pool) == os.SCHED_OTHER and not background.idle


class _Runtime:
    """A stage runtime with no parameters (``StageCopy`` reads them)."""

    def parameters(self):
        return iter(())
