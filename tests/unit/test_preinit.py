"""The preinitialization controller's decisions (leto_run.preinit) over memory observations.

The expectation is independent of the rules: a device simulator keeps its own books (the
active's bytes from a trace, each shadow's bytes at its level) and checks the one thing that
matters, that the active never runs out of memory the shadows hold, while the same trace with
shadows fixed at L3 does run out.  The trend is checked against numpy's least-squares fit.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from leto_run.preinit import (Level, LevelCosts, MemoryObservation, PreinitPolicy, warmup_room,
                              cap_after_reclaim, cap_after_recovery, choose_level,
                              generation_levels, peak_trend, reclaim_plan)

GIB = 1 << 30
MIB = 1 << 20
COSTS = LevelCosts(l2=612 * MIB, l3=1304 * MIB)          # the H200 shadow of issue 21
TOTAL = 80 * GIB


def _trace(t: int) -> int:
    """Active bytes at second t: 70 GiB, up to 79 GiB by t=300, back to 70 GiB by t=600."""
    up = min(t, 300) / 300 if t <= 300 else max(0, 600 - t) / 300
    return int(70 * GIB + up * 9 * GIB)


def _simulate(policy, controlled: bool, seconds: int = 900, shadows: int = 1):
    level, cap, last_down = Level.L3, Level.L3, -1e9
    peaks: list[tuple[float, int]] = []
    oom_at, levels = None, []
    for t in range(seconds):
        active = _trace(t)
        if active + shadows * COSTS.of(level) > TOTAL and oom_at is None:
            oom_at = t                                     # the simulator's own books
        peaks.append((float(t), active))
        window = peaks[-30:]
        obs = MemoryObservation(total=TOTAL, free=max(0, TOTAL - active - shadows *
                                                      COSTS.of(level)),
                                active_peak=max(b for _, b in window[-10:]),
                                trend=peak_trend(window), shadows=shadows)
        if controlled:
            d = choose_level(obs, policy, COSTS, level, cap, t - last_down)
            if d.change == "down":
                last_down = t
            level = d.level
        levels.append(level)
    return oom_at, levels


@pytest.mark.parametrize("shadows", [1, 2])
def test_a_growing_workload_never_runs_out_and_the_shadow_comes_back_to_l3(shadows):
    policy = PreinitPolicy(margin=256 * MIB, horizon_s=30, raise_hold_s=60)
    oom, _ = _simulate(policy, controlled=False, shadows=shadows)
    assert oom is not None and oom < 300            # fixed at L3, the active runs out
    oom, levels = _simulate(policy, controlled=True, shadows=shadows)
    assert oom is None
    assert levels[0] == Level.L3 and levels[-1] == Level.L3
    assert Level.L1 in levels                       # at the peak not even L2 fits
    first_low = levels.index(Level.L1)
    assert first_low < 300                          # down before the peak, not at it
    changes = sum(1 for a, b in zip(levels, levels[1:]) if a != b)
    assert changes <= 5, levels                     # no rebuild/reclaim loop


def test_raising_waits_for_the_hold_and_twice_the_margin():
    policy = PreinitPolicy(margin=GIB, horizon_s=0, raise_hold_s=60)
    obs = MemoryObservation(total=TOTAL, free=3 * GIB, active_peak=70 * GIB)
    # L3 costs 1.27 GiB: 1.73 GiB would stay free -> fits, but not twice the margin; L2 does
    d = choose_level(obs, policy, COSTS, Level.L1, Level.L3, since_down_s=61)
    assert (d.level, d.change) == (Level.L2, "up"), d
    d = choose_level(obs, policy, COSTS, Level.L1, Level.L3, since_down_s=10)
    assert (d.level, d.change) == (Level.L1, "hold") and "10 s ago" in d.reason, d
    roomy = MemoryObservation(total=TOTAL, free=10 * GIB, active_peak=60 * GIB)
    assert choose_level(roomy, policy, COSTS, Level.L1, Level.L3, 61).level == Level.L3
    # going down never waits
    tight = MemoryObservation(total=TOTAL, free=GIB // 2, active_peak=79 * GIB)
    d = choose_level(tight, policy, COSTS, Level.L3, Level.L3, since_down_s=0)
    assert d.change == "down" and d.level == Level.L2, d     # L2 frees 0.67 GiB: 1.17 >= 1


def test_a_rising_trend_steps_down_before_the_memory_is_gone():
    policy = PreinitPolicy(margin=256 * MIB, horizon_s=30)
    obs = MemoryObservation(total=TOTAL, free=2 * GIB, active_peak=76 * GIB,
                            trend=60 * MIB)                   # 1.76 GiB more within 30 s
    d = choose_level(obs, policy, COSTS, Level.L3, Level.L3, 1e9)
    assert (d.change, d.level) == ("down", Level.L2), d
    falling = MemoryObservation(total=TOTAL, free=2 * GIB, active_peak=76 * GIB, trend=-GIB)
    assert choose_level(falling, policy, COSTS, Level.L3, Level.L3, 1e9).change == "hold"


def test_a_pinned_level_that_does_not_fit_warns_and_runs_at_the_one_that_does():
    policy = PreinitPolicy(mode="L3", margin=GIB, horizon_s=0)
    obs = MemoryObservation(total=TOTAL, free=GIB // 2, active_peak=79 * GIB)
    d = choose_level(obs, policy, COSTS, Level.L3, Level.L3, 1e9)
    # 0.5 GiB free + L3 -> L2's 0.67 GiB = 1.17 GiB >= the 1 GiB margin: L2 fits, L3 not
    assert d.warning and d.level == Level.L2 and "preinit L3 does not fit" in d.reason, d
    assert "the shadow runs at L2" in d.reason, d
    pinned = PreinitPolicy(mode="L2", margin=GIB)
    roomy = MemoryObservation(total=TOTAL, free=40 * GIB, active_peak=40 * GIB)
    d = choose_level(roomy, pinned, COSTS, Level.L2, Level.L3, 1e9)
    assert (d.level, d.change, d.warning) == (Level.L2, "hold", False), d


def test_reclaim_plans_the_smallest_drop_that_frees_enough_or_none():
    obs = MemoryObservation(total=TOTAL, free=100 * MIB, active_peak=79 * GIB, shadows=2)
    # L3 -> L2 frees 2 x 692 MiB; L3 -> L1 frees 2 x 1304 MiB
    assert reclaim_plan(1000 * MIB, obs, COSTS, Level.L3).level == Level.L2
    assert reclaim_plan(2000 * MIB, obs, COSTS, Level.L3).level == Level.L1
    d = reclaim_plan(4 * GIB, obs, COSTS, Level.L3)
    assert (d.level, d.change) == (Level.L3, "hold") and "the active's own" in d.reason, d
    assert reclaim_plan(50 * MIB, obs, COSTS, Level.L1).change == "hold"   # nothing to give


def test_the_cap_only_falls_until_the_next_recovery():
    cap = cap_after_reclaim(Level.L3, Level.L2)
    assert cap_after_reclaim(cap, Level.L3) == Level.L2
    assert cap_after_reclaim(cap, Level.L1) == Level.L1
    roomy = MemoryObservation(total=TOTAL, free=40 * GIB, active_peak=40 * GIB)
    policy = PreinitPolicy(margin=GIB)
    assert choose_level(roomy, policy, COSTS, Level.L2, Level.L2, 1e9).level == Level.L2
    assert cap_after_recovery(policy) == Level.L3
    assert cap_after_recovery(PreinitPolicy(mode="L2")) == Level.L2


def test_the_peak_trend_is_numpy_s_least_squares_slope():
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(2, 40)
        ts = sorted(rng.uniform(0, 100) for _ in range(n))
        bs = [rng.randint(0, 80 * GIB) for _ in range(n)]
        want = np.polyfit(np.array(ts), np.array(bs, dtype=np.float64), 1)[0]
        assert peak_trend(list(zip(ts, bs))) == pytest.approx(want, rel=1e-6, abs=1e-3)
    assert peak_trend([(1.0, 5)]) == 0.0 and peak_trend([(1.0, 5), (1.0, 9)]) == 0.0


@pytest.mark.parametrize("make", [
    lambda: PreinitPolicy(mode="L4"),
    lambda: PreinitPolicy(margin=-1),
    lambda: PreinitPolicy(horizon_s=float("nan")),
    lambda: MemoryObservation(total=GIB, free=2 * GIB, active_peak=0),
    lambda: MemoryObservation(total=GIB, free=0, active_peak=0, trend=float("inf")),
    lambda: LevelCosts(l2=2, l3=1),
])
def test_impossible_inputs_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_l3_is_the_whole_generation_s_or_no_one_s():
    L1, L2, L3 = Level.L1, Level.L2, Level.L3
    assert generation_levels([L3, L3, L3])[0] == [L3, L3, L3]
    out, why = generation_levels([L3, L1, L3, L2])
    assert out == [L2, L1, L2, L2] and "rank(s) 1, 3" in why, why
    assert generation_levels([L2, L1])[0] == [L2, L1]


def test_the_warm_up_room_is_what_stays_free_after_every_active_s_regrowth():
    """Hand-computed: 40 GiB free; the active at 18 GiB of a 20 GiB peak (2 back), growing
    0.1 GiB/s over 10 s of trend (1 more), a 1 GiB margin and L3's 1 GiB; two ranks on the
    device share what is left.  A falling trend counts nothing; no room is never negative."""
    G = 1 << 30
    costs = LevelCosts(l2=G // 2, l3=G)
    pol = PreinitPolicy(margin=G, horizon_s=30)
    one = MemoryObservation(total=80 * G, free=40 * G, active_peak=20 * G, trend=0.1 * G,
                            trend_span=10.0, active=18 * G)
    room, why = warmup_room([one], pol, costs, Level.L3)
    assert room == 40 * G - 2 * G - 1 * G - G - G and "40.00 GiB free" in why
    other = MemoryObservation(total=80 * G, free=40 * G, active_peak=6 * G, trend=-1.0 * G,
                              trend_span=10.0, active=6 * G)
    assert warmup_room([one, other], pol, costs, Level.L2)[0] == (40 * G - 2 * G - G - G - G) // 2
    full = MemoryObservation(total=80 * G, free=G, active_peak=70 * G, active=70 * G)
    assert warmup_room([full], pol, costs, Level.L3)[0] == 0
