"""The auditor's copy stepper on CPU time nobody else wants (``planner.runtime.rank.audits``, issue 37).

A step's deferred recomputes and the copy's optimizer step (``audit_recompute``, ``audit_copy``) are due only at
the next step's end, so on a CPU device their thread runs at the idle scheduling class (Linux ``SCHED_IDLE``): the
rank's own passes, and the other ranks sharing its cores, go first, and the audit work fills the pipeline's
bubbles (the fill, the drain, waits on messages) instead of stretching the passes on the step's path. Where the
run's thread waits for that work (a verdict due, the copy needed: ``urgent``) the thread is back at the normal
class for the wait, so it never starves the step it holds up. On a GPU the thread only launches kernels and stays
at the normal class; so does it where the platform would not let it back (``_can_return``) or where torch runs
intra-op threads (they would inherit the idle class and stay there). An idle thread preempted holding the GIL
can still delay the run's thread on a saturated core (measured by review: GIL wait p90 13.9 -> 37.1 ms at load 4).

What the replica sees does not change: the work, its amount and when it is due are the same; only which CPU time
runs it (the audited microbatches stay as secret as before: the recomputes run after the audited step's tensors
all left).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_IDLE = getattr(os, "SCHED_IDLE", None)     # Linux only; elsewhere the thread keeps its class
_NORMAL = getattr(os, "SCHED_OTHER", None)


def _set_class(tid: int, policy: int | None) -> bool:
    """Put thread ``tid`` (0: the caller) in scheduling class ``policy``; False where the platform refuses."""
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except (OSError, ValueError):
        return False
    return True


def _can_return() -> bool:
    """Whether a thread put at the idle class may go back to the normal class: without ``CAP_SYS_NICE`` and with
    ``RLIMIT_NICE`` 0 (a non-root user, Docker's default) Linux refuses, and ``urgent`` would then leave the step
    waiting on an idle thread. Probed on a throwaway thread."""
    ok: list[bool] = []
    probe = threading.Thread(target=lambda: ok.append(_set_class(0, _IDLE) and _set_class(0, _NORMAL)))
    probe.start()
    probe.join()
    return bool(ok and ok[0])


class Background:
    """The copies' stepper thread's scheduling class: idle (``start``, its initializer), normal while the run's
    thread waits on it (``urgent``)."""

    def __init__(self, device: torch.device) -> None:
        # on a GPU the thread launches kernels: never starve it; with intra-op threads, those the stepper starts
        # inherit the idle class and ``urgent`` raises its own thread only
        self.wanted = device.type == "cpu" and torch.get_num_threads() == 1 and _can_return()
        self.tid: int | None = None           # the stepper's native thread id, once it runs idle
        self._lock = threading.Lock()
        self._waiting = 0

    def start(self) -> None:
        """On the stepper thread as it starts: the idle class (where wanted and the platform allows)."""
        if self.wanted and _set_class(0, _IDLE):
            self.tid = threading.get_native_id()

    @property
    def idle(self) -> bool:
        """Whether the stepper runs at the idle class outside ``urgent`` waits."""
        return self.tid is not None

    @contextmanager
    def urgent(self) -> Iterator[None]:
        """The run's thread waits on the stepper: it runs at the normal class meanwhile."""
        tid = self.tid
        if tid is None:
            yield
            return
        with self._lock:
            self._waiting += 1
            if self._waiting == 1:
                _set_class(tid, _NORMAL)
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    _set_class(tid, _IDLE)


@contextmanager
def urgent(background: Background | None) -> Iterator[None]:
    """``background.urgent()``, or nothing where there is none (a copy without a stepper, a test's)."""
    if background is None:
        yield
        return
    with background.urgent():
        yield
