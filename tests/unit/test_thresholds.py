"""The IQR fence over a rolling window of honest scores."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InvalidInputError
from planner.integrity.thresholds import Cusum, IQRFence


def test_no_fence_before_min_samples() -> None:
    fence = IQRFence(window=16, k=3.0, min_samples=4)
    for score in (1.0, 2.0, 3.0):
        fence.update(score)
        assert not fence.ready and fence.fence() is None
        assert not fence.exceeds(1e9)          # nothing is flagged before the fence exists
    fence.update(4.0)
    assert fence.ready and fence.fence() is not None


def test_a_fallback_fence_stands_in_until_the_window_fills() -> None:
    twin = IQRFence(window=16, k=3.0, min_samples=2, floor=0.5)
    fence = IQRFence(window=16, k=3.0, min_samples=4, fallback=twin)
    assert fence.fence() is None and not fence.exceeds(1e9)   # neither is ready
    twin.update(0.1)
    twin.update(0.1)
    assert fence.fence() == 0.5 and fence.exceeds(0.6) and not fence.exceeds(0.4)
    for score in (1.0, 2.0, 3.0, 4.0):
        fence.update(score)
    assert fence.fence() == pytest.approx(3.25 + 3.0 * 1.5)    # its own window, once it has one


def test_fence_is_q3_plus_k_iqr_by_hand() -> None:
    fence = IQRFence(window=8, k=3.0, min_samples=1)
    for score in range(1, 9):                  # 1..8: Q1 = 2.75, Q3 = 6.25 (linear interpolation)
        fence.update(float(score))
    assert fence.quartiles() == pytest.approx((2.75, 6.25))
    assert fence.fence() == pytest.approx(6.25 + 3.0 * 3.5)
    assert not fence.exceeds(16.75) and fence.exceeds(16.76)


def test_floor_and_ratio_bound_the_fence_from_below() -> None:
    flat = IQRFence(window=8, k=3.0, min_samples=4, floor=0.5)
    for _ in range(4):
        flat.update(0.1)                       # IQR 0: without a floor any 0.11 would be flagged
    assert flat.fence() == pytest.approx(0.5)
    ratio = IQRFence(window=8, k=3.0, min_samples=4, ratio=3.0)
    for _ in range(4):
        ratio.update(0.1)
    assert ratio.fence() == pytest.approx(0.3)  # 3 x the median


def test_window_rolls_and_drops_the_oldest() -> None:
    fence = IQRFence(window=4, k=1.0, min_samples=4)
    for score in (100.0, 1.0, 2.0, 3.0, 4.0):
        fence.update(score)
    assert len(fence) == 4
    assert fence.quartiles() == pytest.approx(tuple(np.percentile([1.0, 2.0, 3.0, 4.0], [25, 75])))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1, max_size=60),
       st.integers(min_value=4, max_value=20))
def test_quartiles_match_numpy_on_the_last_window(scores: list[float], window: int) -> None:
    fence = IQRFence(window=window, k=3.0, min_samples=1)
    for score in scores:
        fence.update(score)
    expected = np.percentile(np.array(scores[-window:]), [25, 75])
    assert fence.quartiles() == pytest.approx(tuple(expected), rel=1e-9, abs=1e-9)


def test_non_finite_scores() -> None:
    fence = IQRFence(window=8, k=3.0, min_samples=2)
    with pytest.raises(InvalidInputError, match="finite"):
        fence.update(float("nan"))
    fence.update(1.0)
    fence.update(2.0)
    assert fence.exceeds(float("nan")) and fence.exceeds(float("inf"))


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 2, "k": 3.0, "min_samples": 1}, "window"),
    ({"window": 8, "k": 0.0, "min_samples": 1}, "iqr_k"),
    ({"window": 8, "k": 3.0, "min_samples": 9}, "min_samples"),
    ({"window": 8, "k": 3.0, "min_samples": 1, "floor": -1.0}, "floor"),
    ({"window": 8, "k": 3.0, "min_samples": 1, "ratio": -1.0}, "ratio"),
])
def test_bad_parameters(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        IQRFence(**kwargs)


# ---------------------------------------------------------------------------- the CUSUM drift test

def honest(cusum: Cusum, scores) -> list[float]:
    """Check and accept each score (as a monitor does for a sample that passes)."""
    values = []
    for s in scores:
        values.append(cusum.step(float(s)))
        cusum.learn(float(s))
    return values


def test_cusum_stays_low_on_honest_scatter_and_crosses_on_a_persistent_rise() -> None:
    rng = np.random.default_rng(0)
    cusum = Cusum(window=64, k=1.5)
    assert cusum.z(1.0) is None                                   # no baseline yet: no statistic
    values = honest(cusum, np.exp(rng.normal(0.0, 0.2, 400)))     # log-normal scatter around 1
    assert max(values[16:]) < 8.0
    # Twice the median, each sample well inside any fence on the score itself: ~3.5 spreads above.
    attacked = [cusum.step(2.0) for _ in range(6)]
    assert attacked[-1] > 8.0 and attacked == sorted(attacked)


def test_cusum_one_outlier_is_capped_and_out_of_control_samples_do_not_teach() -> None:
    cusum = Cusum(window=32, k=1.5, cap=4.0)
    honest(cusum, [1.0, 1.1, 0.9, 1.05, 0.95] * 8)
    assert cusum.step(1e6) == pytest.approx(4.0 - 1.5)            # capped at cap - k
    before = cusum.z(1.0)
    for _ in range(20):
        cusum.learn(3.0)                                          # z >= k: never enters the baseline
    assert cusum.z(1.0) == pytest.approx(before)
    with pytest.raises(InvalidInputError, match="drift"):
        Cusum(window=8, k=0.0)


def test_a_capped_fence_is_never_above_its_twins() -> None:
    twin = IQRFence(window=16, k=3.0, min_samples=2, floor=0.2)
    step = IQRFence(window=16, k=3.0, min_samples=4, floor=0.1, fallback=twin, capped=True)
    for score in (0.5, 0.6, 0.1, 0.1):        # early turbulence in the step window: its own fence 1.8
        step.update(score)
    assert step.fence() > 1.0                  # the twin is not ready: nothing to cap with yet
    twin.update(0.05)
    twin.update(0.06)
    assert step.fence() == pytest.approx(0.2) and step.exceeds(0.45)
    loose = IQRFence(window=16, k=3.0, min_samples=4, floor=0.1, fallback=twin)
    for score in (0.5, 0.6, 0.1, 0.1):
        loose.update(score)
    assert loose.fence() > 1.0 and not loose.exceeds(0.45)  # uncapped: the early window's fence
