"""Distances of the integrity monitors, checked against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity import distances as dist
from planner.integrity import predictors as pred
from planner.integrity import summaries as summ

torch.set_num_threads(1)


def summary(mean, std, *, skew=None, quantiles=None, pmean=None, cov=None, sketch=()) -> summ.Summary:
    mean = torch.tensor(mean, dtype=torch.float32)
    std = torch.tensor(std, dtype=torch.float32)
    return summ.Summary(
        mean=mean, std=std,
        skew=torch.zeros_like(mean) if skew is None else torch.tensor(skew, dtype=torch.float32),
        quantiles=torch.zeros(1, 2) if quantiles is None else torch.tensor(quantiles, dtype=torch.float32),
        pmean=mean.clone() if pmean is None else torch.tensor(pmean, dtype=torch.float32),
        cov=torch.eye(mean.numel()) if cov is None else torch.tensor(cov, dtype=torch.float32),
        sketch=torch.tensor(sketch, dtype=torch.float32))


def test_rows_use_last_dim_and_channels_of_feature_maps() -> None:
    assert summ.as_rows(torch.zeros(2, 3, 5)).shape == (6, 5)
    fmap = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    rows = summ.as_rows(fmap)
    assert rows.shape == (32, 3)
    assert torch.equal(rows[:, 1].sort().values, fmap[:, 1].reshape(-1).sort().values)
    assert summ.feature_size(fmap) == 3 and summ.feature_size(torch.zeros(7, 5)) == 5
    with pytest.raises(InvalidInputError, match="boundary tensor"):
        summ.as_rows(torch.tensor(1.0))
    with pytest.raises(InvalidInputError):
        summ.feature_size(torch.zeros(0, 4))


def test_summarize_moments_quantiles_and_covariance() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0], [7.0, 2.0]])
    s = summ.summarize(x, directions=torch.eye(2), levels=summ.quantile_levels(4),
                       sketch_at=torch.tensor([0, 3]))
    assert torch.allclose(s.mean, torch.tensor([4.0, 2.0]))
    assert torch.allclose(s.std, torch.tensor([math.sqrt(5.0), math.sqrt(2.0)]))
    assert torch.allclose(s.skew, torch.zeros(2), atol=1e-6)           # both columns symmetric
    assert torch.equal(s.quantiles, torch.tensor([[1.0, 3.0, 5.0, 7.0], [0.0, 2.0, 2.0, 4.0]]))
    assert torch.allclose(s.cov, torch.tensor([[5.0, -1.0], [-1.0, 2.0]]))
    assert torch.equal(s.sketch, torch.tensor([-3.0, 2.0]))             # centred values at flat 0 and 3


def test_skewness_sign_and_constant_features() -> None:
    x = torch.tensor([[0.0, 5.0], [0.0, 5.0], [0.0, 5.0], [3.0, 5.0]])  # right-skewed, constant
    s = summ.summarize(x, directions=torch.eye(2), levels=summ.quantile_levels(2))
    assert s.skew[0] == pytest.approx(1.0 / math.sqrt(3.0) * 2.0, rel=1e-5)  # Bernoulli: (1-2p)/sqrt(p(1-p)), p=1/4
    assert s.skew[1] == 0.0
    flipped = summ.summarize(-x, directions=torch.eye(2), levels=summ.quantile_levels(2))
    assert flipped.skew[0] == pytest.approx(-float(s.skew[0]), rel=1e-6)


def test_mean_abs_diff_and_l2_by_hand() -> None:
    ref = summary([1.0, 1.0], [1.0, 1.0])      # rms sqrt(2): shape = (1, 1, 1, 1) / sqrt(2)
    x = summary([1.0, -1.0], [1.0, 1.0])       # shape (1, -1, 1, 1) / sqrt(2)
    assert dist.mean_abs_diff(x, ref) == pytest.approx(0.5)   # (2/sqrt2)/4 over 1/sqrt2
    assert dist.normalized_l2(x, ref) == pytest.approx(1.0)   # (2/sqrt2) over sqrt(4/2)
    assert dist.mean_abs_diff(ref, ref) == 0.0
    # Size is not shape: the same statistics at 3x the scale score 0.
    big = summary([3.0, 3.0], [3.0, 3.0])
    assert dist.mean_abs_diff(big, ref) == pytest.approx(0.0, abs=1e-7)
    assert dist.normalized_l2(summary([0.0, 0.0], [0.0, 0.0]), ref) == pytest.approx(1.0)


def test_scale_change_by_hand() -> None:
    ref = summary([0.0, 0.0], [1.0, 1.0])
    assert dist.rms(ref) == pytest.approx(1.0)
    assert dist.scale_change(summary([0.0, 0.0], [math.e, math.e]), ref) == pytest.approx(1.0, rel=1e-6)
    assert dist.scale_change(summary([0.0, 0.0], [0.5, 0.5]), ref) == pytest.approx(math.log(2.0), rel=1e-6)
    assert dist.scale_change(summary([0.0, 0.0], [0.0, 0.0]), ref) == pytest.approx(-math.log(summ.EPS))


def test_sign_flip_ratio_weighs_by_reference_mean() -> None:
    ref = summary([2.0, -1.0, 0.5], [1.0, 1.0, 1.0])
    x = summary([1.0, 1.0, 0.5], [1.0, 1.0, 1.0])
    assert dist.sign_flip_ratio(x, ref) == pytest.approx(1.0 / 3.5)
    assert dist.sign_flip_ratio(summary([-2.0, 1.0, -0.5], [1.0] * 3), ref) == pytest.approx(1.0)
    assert dist.sign_flip_ratio(summary([0.0, 0.0, 0.0], [1.0] * 3), ref) == pytest.approx(1.0)


def test_skew_flip_by_hand() -> None:
    ref = summary([0.0, 0.0], [1.0, 1.0], skew=[1.0, 0.0])
    assert dist.skew_flip(summary([0.0, 0.0], [1.0, 1.0], skew=[2.0, 0.0]), ref) == pytest.approx(0.0)
    assert dist.skew_flip(summary([0.0, 0.0], [1.0, 1.0], skew=[-1.0, 0.0]), ref) == pytest.approx(1.0)
    assert dist.skew_flip(summary([0.0, 0.0], [1.0, 1.0], skew=[0.0, 3.0]), ref) == pytest.approx(0.5)
    assert dist.skew_flip(summary([0.0, 0.0], [1.0, 1.0], skew=[0.0, 0.0]), ref) == pytest.approx(0.5)


def test_sliced_wasserstein_by_hand() -> None:
    ref = summary([0.0], [1.0], quantiles=[[-1.0, 1.0]])       # rms 1, spread 1
    x = summary([0.0], [1.0], quantiles=[[-1.0, 3.0]])         # moved the upper half by 2
    assert dist.sliced_wasserstein(x, ref) == pytest.approx(1.0)
    assert dist.sliced_wasserstein(ref, ref) == 0.0
    with pytest.raises(InvalidInputError, match="quantile"):
        dist.sliced_wasserstein(summary([0.0], [1.0], quantiles=[[1.0, 2.0, 3.0]]), ref)


def test_sliced_wasserstein_samples_is_the_shift_in_one_dimension() -> None:
    a = torch.randn(200, 1, generator=torch.Generator().manual_seed(0))
    assert dist.sliced_wasserstein_samples(a, a + 0.5) == pytest.approx(0.5, rel=1e-5)
    assert dist.sliced_wasserstein_samples(a, a) == 0.0
    with pytest.raises(InvalidInputError):
        dist.sliced_wasserstein_samples(a, a[:10])


def test_principal_basis_and_spectral_residual_by_hand() -> None:
    cov = [[10.0, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, 0.2]]   # 10/10.4 = 96% in e1
    ref = summary([0.0] * 3, [1.0] * 3, pmean=[0.0] * 3, cov=cov)
    basis = dist.principal_basis(ref.cov)
    assert basis.shape == (3, 1) and abs(float(basis[0, 0])) == pytest.approx(1.0)
    iso = summary([0.0] * 3, [1.0] * 3, pmean=[0.0] * 3, cov=torch.eye(3).tolist())
    assert dist.spectral_residual(iso, ref, basis) == pytest.approx(2.0 / 3.0)
    aligned = summary([0.0] * 3, [1.0] * 3, pmean=[0.0] * 3, cov=[[3.0, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert dist.spectral_residual(aligned, ref, basis) == pytest.approx(0.0, abs=1e-7)
    shifted = summary([0.0] * 3, [1.0] * 3, pmean=[0.0, 1.0, 0.0], cov=torch.zeros(3, 3).tolist())
    assert dist.spectral_residual(shifted, ref, basis) == pytest.approx(1.0)
    two = dist.principal_basis(torch.diag(torch.tensor([4.0, 1.0, 0.0])))  # 80% < 95% -> two vectors
    assert two.shape == (3, 2)


def test_replay_score() -> None:
    past = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert pred.replay_score(torch.tensor([0.0, 2.0, 0.0]), past) == pred.REPLAY_SCORE_CAP
    assert pred.replay_score(torch.tensor([0.0, 0.0, 1.0]), past) == 0.0
    cos = 0.9
    near = torch.tensor([cos, math.sqrt(1 - cos ** 2), 0.0])
    assert pred.replay_score(torch.tensor([near[0], 0.0, near[1]]), past) == pytest.approx(1.0, rel=1e-4)
    assert pred.replay_score(torch.tensor([1.0, 0.0, 0.0]), torch.empty(0, 3)) == 0.0


def test_mean_summary_blend_and_helpers() -> None:
    a = summary([0.0, 2.0], [1.0, 1.0])
    b = summary([2.0, 4.0], [3.0, 1.0])
    m = summ.mean_summary([a, b])
    assert torch.equal(m.mean, torch.tensor([1.0, 3.0])) and torch.equal(m.std, torch.tensor([2.0, 1.0]))
    e = a.blend(b, 0.75)
    assert torch.allclose(e.mean, torch.tensor([0.5, 2.5])) and torch.allclose(e.std, torch.tensor([1.5, 1.0]))
    with pytest.raises(InvalidInputError):
        summ.mean_summary([])
    d1, d2 = summ.random_directions(8, 4, seed=3), summ.random_directions(8, 4, seed=3)
    assert torch.equal(d1, d2) and torch.allclose(d1.norm(dim=0), torch.ones(4))
    pos = summ.sketch_positions(10_000, 64, seed=1)
    assert pos.numel() == 64 and torch.equal(pos, summ.sketch_positions(10_000, 64, seed=1))
    assert torch.equal(summ.sketch_positions(5, 64, seed=1), torch.arange(5))
    assert summ.spectral_projection(64, seed=0) is None
    assert summ.spectral_projection(1000, seed=0).shape == (1000, summ.MAX_SPECTRAL_DIMS)
    values = torch.tensor([[3.0], [1.0], [2.0], [4.0]])
    assert torch.equal(summ.sorted_quantiles(values, summ.quantile_levels(4)), torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


def test_noise_raises_the_spectral_residual_of_low_rank_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(32, 3, generator=gen)
    honest = [torch.randn(64, 3, generator=gen) @ basis.T for _ in range(4)]
    dirs, levels = summ.random_directions(32, 8, 0), summ.quantile_levels(8)
    sums = [summ.summarize(h, directions=dirs, levels=levels) for h in honest]
    ref = summ.mean_summary(sums[:3])
    b = dist.principal_basis(ref.cov)
    clean = dist.spectral_residual(sums[3], ref, b)
    noisy_rows = honest[3] + 0.3 * honest[3].std() * torch.randn(64, 32, generator=gen)
    noisy = dist.spectral_residual(summ.summarize(noisy_rows, directions=dirs, levels=levels), ref, b)
    assert clean < 0.01 and noisy > 0.05


def test_summary_scores_in_one_pass_equal_each_distance() -> None:
    gen = torch.Generator().manual_seed(1)
    dirs, levels = summ.random_directions(24, 8, 0), summ.quantile_levels(16)
    rows = torch.randn(128, 6, generator=gen) @ torch.randn(6, 24, generator=gen)
    ref = summ.summarize(rows.exp(), directions=dirs, levels=levels)
    for other in (rows.exp() * 1.7 + 0.2 * torch.randn(128, 24, generator=gen), -rows.exp(), torch.zeros(128, 24)):
        x = summ.summarize(other, directions=dirs, levels=levels)
        fast = dist.summary_scores(x, dist.reference(ref))
        slow = {name: dist.DISTANCES[name](x, ref) for name in dist.DISTANCES}
        slow["spectral"] = dist.spectral_residual(x, ref, dist.principal_basis(ref.cov))
        assert fast.keys() == slow.keys()
        for name in fast:
            assert fast[name] == pytest.approx(slow[name], rel=1e-5, abs=1e-6), name
    only = dist.summary_scores(x, dist.reference(ref, spectral=False), ("scale", "sign"))
    assert set(only) == {"scale", "sign"}


def test_residual_shape_sees_energy_where_honest_residuals_have_none() -> None:
    gen = torch.Generator().manual_seed(2)
    k = 16
    directions = torch.randn(k, 3, generator=gen)               # honest residuals live in 3 of 16 directions

    def residual(noise: float) -> torch.Tensor:
        r = torch.randn(256, 3, generator=gen) @ directions.T
        r = r + noise * r.std() * torch.randn(256, k, generator=gen)
        return r.T @ r

    whitener = pred.residual_whitener(sum(residual(0.0) for _ in range(8)))
    honest = [pred.residual_shape(residual(0.0), whitener) for _ in range(5)]
    assert all(0.8 < h < 1.2 for h in honest)
    # A tenth of the residual's energy spread evenly: the residual grows by 10%, its shape score 5-fold.
    assert pred.residual_shape(residual(0.3), whitener) > 4.0
    assert pred.residual_shape(torch.zeros(k, k), whitener) == 0.0


def test_link_fit_is_link_parts_and_link_stats_in_one() -> None:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 5, generator=gen)
    w = pred.link_solve(*pred.link_stats(x, y))
    parts, stats = pred.link_fit(x, y, w)
    num, den, moment = pred.link_parts(x, y, w)
    assert parts[0] == pytest.approx(num) and parts[1] == pytest.approx(den)
    assert torch.allclose(parts[2], moment) and torch.allclose(moment.trace(), torch.tensor(num))
    assert all(torch.allclose(a, b) for a, b in zip(stats, pred.link_stats(x, y)))
    assert pred.link_fit(x, y, None)[0] is None


def test_row_subsets_are_fixed_by_their_seed_and_only_for_large_tensors() -> None:
    assert summ.row_subset(summ.MAX_PROJECTED_ROWS, seed=1) is None
    rows = summ.MAX_PROJECTED_ROWS * 3
    a, b = summ.row_subset(rows, seed=1), summ.row_subset(rows, seed=1)
    assert torch.equal(a, b) and a.numel() == summ.MAX_PROJECTED_ROWS
    assert torch.equal(a, a.unique()) and int(a.max()) < rows                 # sorted, distinct, in range
    assert not torch.equal(a, summ.row_subset(rows, seed=summ.stable_mix(0, 5, 1)))
    assert summ.stable_mix(0, 5, 1) == summ.stable_mix(0, 5, 1) != summ.stable_mix(0, 1, 5)
    big = torch.randn(rows, 8)
    s = summ.summarize(big, directions=summ.random_directions(8, 4, 0), levels=summ.quantile_levels(8), subset=a)
    assert torch.allclose(s.mean, big.mean(dim=0))            # the per-feature mean still sees every row
    spread = (big[a] - big.mean(dim=0)).square().mean(dim=0).sqrt()
    assert torch.allclose(s.std, spread, atol=1e-5)            # the spread: the subset only
    assert torch.allclose(s.cov, big[a].T.cov(correction=0), atol=1e-5)


def test_a_replayed_large_tensor_gives_back_its_sketch_whatever_subset_it_draws() -> None:
    gen = torch.Generator().manual_seed(4)
    rows = summ.MAX_PROJECTED_ROWS * 2
    x = torch.randn(2, rows // 2, 16, generator=gen) * 3.0 + 1.0
    at = summ.sketch_positions(x.numel(), 64, seed=0)
    dirs, levels = summ.random_directions(16, 4, 0), summ.quantile_levels(8)
    first, again = (summ.summarize(x, directions=dirs, levels=levels, sketch_at=at,
                                   subset=summ.row_subset(rows, seed=seed)) for seed in (1, 2))
    assert not torch.equal(first.std, again.std)                              # two subsets...
    assert torch.equal(first.sketch, again.sketch)                            # ...one sketch: a replay scores the cap
    assert pred.replay_score(again.sketch, first.sketch[None]) == pred.REPLAY_SCORE_CAP
    flat = summ.as_rows(x)
    assert torch.allclose(first.sketch, flat.reshape(-1)[at] - flat.mean(dim=0)[at % 16])


def test_one_projection_for_quantiles_and_spectral_basis_matches_two() -> None:
    gen = torch.Generator().manual_seed(5)
    dim = summ.MAX_SPECTRAL_DIMS * 3
    x = torch.randn(96, 8, generator=gen) @ torch.randn(8, dim, generator=gen)
    dirs, levels = summ.random_directions(dim, 4, 0), summ.quantile_levels(8)
    spectral = summ.spectral_projection(dim, 1)
    s, unit = summ.summarize_rows(x, directions=dirs, levels=levels, spectral=spectral)
    assert torch.allclose(s.quantiles, summ.sorted_quantiles(x @ dirs, levels), rtol=1e-4, atol=1e-4)
    prows = x @ spectral
    assert torch.allclose(s.pmean, prows.mean(dim=0), rtol=1e-4, atol=1e-4)
    assert torch.allclose(s.cov, prows.T.cov(correction=0), rtol=1e-3, atol=1e-3)
    assert unit.shape == (96, summ.MAX_SPECTRAL_DIMS)
