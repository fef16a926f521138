"""Price the sequence DP's relaxed plans on a second thread while the bound's DPs run (``lagrange``).

The DP kernel releases the GIL (numba ``nogil``), so on two cores the bound's DPs and the pricing of
the plans they meet (repair, re-partitioning, exact evaluation: mostly Python) run at once instead of
taking turns, where pricing in turn was held to a share of the time. The newest plans are priced
first: they come from the latest, tightest boxes, where the bound meets the optimum and the relaxed
plans are the good ones; when pricing falls behind, the oldest waiting plans are dropped.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BackgroundPricer(Generic[T]):
    """Calls ``price`` on submitted items on one daemon thread, newest first, at most ``backlog`` waiting."""

    def __init__(self, price: Callable[[T], None], *, backlog: int, duty: float = 1.0) -> None:
        self._price = price
        self._duty = duty  # the share of the time the thread prices: it rests (1 - duty) / duty of each item's time
        self._waiting: deque[T] = deque(maxlen=backlog)
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._last: Callable[[], None] | None = None  # run once, before the next item (``then``)
        self.priced = self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="stagewise-pricer", daemon=True)
        self._thread.start()

    def submit(self, item: T) -> None:
        with self._cond:
            if len(self._waiting) == self._waiting.maxlen:
                self.dropped += 1
            self._waiting.append(item)
            self._cond.notify()

    def then(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the thread once, after the item it is pricing; pricing resumes after it."""
        with self._cond:
            self._last = job
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed and self._last is None:
                    self._cond.wait()
                if self._closed:
                    return
                job, self._last = self._last, None
                item = self._waiting.pop() if job is None else None
            t0 = time.perf_counter()
            try:
                if job is not None:
                    job()
                    continue
                self._price(item)
                self.priced += 1
            except BaseException as exc:  # re-raised by close(), on the caller's thread
                self._error = exc
                return
            if self._duty < 1.0:  # rest, however many items arrive meanwhile, unless closed
                until = time.perf_counter() + (time.perf_counter() - t0) * (1.0 - self._duty) / self._duty
                with self._cond:
                    while not self._closed and time.perf_counter() < until:
                        self._cond.wait(until - time.perf_counter())

    def close(self, *, drain: int = 0) -> None:
        """Stop the thread after the item it is pricing; then price up to ``drain`` of the newest items
        still waiting on this thread (the rest are dropped). Re-raises what pricing raised."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        with self._cond:
            last = [self._waiting.pop() for _ in range(min(drain, len(self._waiting)))]
            self.dropped += len(self._waiting)
            self._waiting.clear()
        for item in last:
            self._price(item)
            self.priced += 1
