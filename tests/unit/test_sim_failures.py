"""The seeded failure process (leto_sim/failures.py): determinism, coupling across HOF ratios,
and its statistics for fixed seeds (exponential inter-arrivals of mean MTTF, HOF share h)."""
from __future__ import annotations

import numpy as np
import pytest

from leto_sim.failures import draw_schedule, seed_list


def test_same_seed_same_schedule_different_seed_different():
    a, b = draw_schedule(600.0, 86400.0, 7), draw_schedule(600.0, 86400.0, 7)
    assert np.array_equal(a.times, b.times) and np.array_equal(a.class_draw, b.class_draw)
    c = draw_schedule(600.0, 86400.0, 8)
    assert not np.array_equal(a.times[:10], c.times[:10])


def test_times_sorted_inside_horizon():
    s = draw_schedule(60.0, 3600.0, 0)
    assert np.all(np.diff(s.times) > 0)
    assert s.times[0] >= 0 and s.times[-1] < 3600.0


def test_statistics_for_a_fixed_seed():
    mttf, horizon = 600.0, 600.0 * 20000        # 20,000 failures expected
    s = draw_schedule(mttf, horizon, 1234)
    n = len(s)
    # Poisson count: sd = sqrt(20000) ~ 141; allow 5 sd.
    assert abs(n - 20000) < 5 * np.sqrt(20000)
    gaps = np.diff(np.concatenate([[0.0], s.times]))
    # Exponential: mean = MTTF, sd = MTTF; the mean of n gaps has sd MTTF/sqrt(n).
    assert abs(gaps.mean() - mttf) < 5 * mttf / np.sqrt(n)
    assert abs(gaps.std() - mttf) < 0.05 * mttf
    # Memorylessness: P(gap > MTTF) = e^-1.
    assert abs((gaps > mttf).mean() - np.exp(-1)) < 5 * np.sqrt(0.25 / n)
    for h in (0.0, 0.3, 0.5, 1.0):
        share = s.is_hof(h).mean()
        assert abs(share - h) < 5 * np.sqrt(max(h * (1 - h), 1e-12) / n) + 1e-12


def test_hof_ratio_coupling():
    s = draw_schedule(600.0, 86400.0, 3)
    lo, hi = s.is_hof(0.3), s.is_hof(0.7)
    assert np.all(hi[lo])                     # every HOF at 0.3 is still a HOF at 0.7
    assert not s.is_hof(0.0).any() and s.is_hof(1.0).all()


def test_seed_list_and_bad_inputs():
    assert seed_list(5, 3) == [5, 6, 7]
    with pytest.raises(ValueError):
        draw_schedule(0.0, 10.0, 0)
