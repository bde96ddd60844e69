"""ETTR (leto_sim/ettr.py): exact hand-computed timelines, the Monte-Carlo mean against the
paper's closed-form prediction where its assumptions hold, and the HOF-ratio trends."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from leto_sim import closed_form_ettr, parse_config, simulate, simulate_run
from leto_sim.failures import Schedule
from leto_sim.systems import SystemModel

ROOT = Path(__file__).resolve().parents[2]


def small(**failures) -> dict:
    raw = yaml.safe_load((ROOT / "configs/sim/small.yaml").read_text())
    raw["failures"].update(failures)
    return raw


def sched(times, hof, horizon) -> tuple[Schedule, np.ndarray]:
    return Schedule(np.array(times, float), np.zeros(len(times)), horizon), np.array(hof, bool)


def test_in_place_timeline_by_hand():
    # 1 s iterations; a HOF at 3.5 s costs 5 s down and the half-done iteration 4.
    m = SystemModel("x", 1.0, 1.0, 0.0, 10, 5.0, 99.0, False)
    s, hof = sched([3.5], [True], 20.0)
    r = simulate_run(m, s, hof)
    # 3 iterations by 3.5 s; resume at 8.5 s; 11 more by 19.5 s.
    assert (r.iterations, r.t_eval) == (14, pytest.approx(19.5))
    assert r.ettr == pytest.approx(14 / 19.5)


def test_rollback_timeline_by_hand():
    # Interval 2: every even iteration commits and takes 1.5 s; the others 1 s.
    m = SystemModel("x", 1.0, 1.0, 0.5, 2, 2.0, 2.0, True)
    s, hof = sched([4.0], [False], 11.5)
    r = simulate_run(m, s, hof)
    # Iterations 1..3 end at 1, 2.5, 3.5; checkpoint 2 is usable (iteration 3 completed).
    # Failure at 4: roll back to 2, resume at 6; 3, 4, 5, 6 end at 7, 8.5, 9.5, 11 (7 would
    # end at 12, after the 11.5 s horizon).
    assert (r.iterations, r.t_eval) == (6, pytest.approx(11.0))


def test_checkpoint_not_usable_until_next_iteration():
    m = SystemModel("x", 1.0, 1.0, 0.0, 2, 1.0, 1.0, True)
    s, hof = sched([2.5], [False], 5.0)         # iteration 2 committed, 3 not yet complete
    r = simulate_run(m, s, hof)
    # Rolled back to 0, resumed at 3.5: iteration 1 ends at 4.5, iteration 2 would at 5.5.
    assert r.iterations == 1 and r.t_eval == pytest.approx(4.5)


def test_failure_during_recovery_restarts_it():
    m = SystemModel("x", 1.0, 1.0, 0.0, 100, 5.0, 5.0, False)
    s, hof = sched([2.5, 4.0], [True, True], 20.0)
    r = simulate_run(m, s, hof)
    # Resume at 4 + 5 = 9 (the second failure restarts recovery); 2 + 11 iterations by 20.
    assert r.iterations == 13 and r.t_eval == pytest.approx(20.0)


def slack(res, name) -> float:
    """The closed form's neglected second-order term, (T_rec / MTTF)^2, per system."""
    from leto_sim.iteration import iteration_time
    from leto_sim.systems import build_systems
    cfg = parse_config(small(mttf="4h", horizon="60d", seeds=40))
    m = {x.name: x for x in build_systems(cfg, iteration_time(cfg.workload).total, res.mttf,
                                          res.hof_ratio)}[name]
    return (m.oracle_terms(res.hof_ratio)[1] / res.mttf) ** 2


@pytest.mark.parametrize("h", [0.0, 1.0])
def test_monte_carlo_agrees_with_closed_form(h):
    # T_rec << MTTF (4 h) and 60 days per seed: the paper's assumptions for Eq. 6 hold.
    res = simulate(parse_config(small(mttf="4h", horizon="60d", seeds=40)), hof_ratio=h)
    for s in res.systems:
        eps = slack(res, s.name)
        assert s.ci_low - eps <= s.oracle <= s.ci_high + eps, (s.name, s)
        assert s.ci_high - s.ci_low < 0.005


def test_leto_rises_with_hof_ratio_and_gemini_does_not_change():
    cfg = parse_config(small(seeds=12))
    runs = [simulate(cfg, hof_ratio=h) for h in (0.0, 0.25, 0.5, 0.75, 1.0)]
    leto = [r.systems[0].mean for r in runs]
    assert [r.systems[0].name for r in runs] == ["leto"] * 5
    assert all(a < b for a, b in zip(leto, leto[1:])), leto
    gemini = [r.systems[1].per_seed for r in runs]
    assert all(g == gemini[0] for g in gemini)     # the same path for both classes
    # With no HOF Leto pays its RMU overhead on Gemini+'s recovery path: it trails slightly.
    assert runs[0].systems[0].mean < runs[0].systems[1].mean


def test_closed_form_by_hand():
    m = SystemModel("x", 1.0, 1.0, 0.5, 10, 20.0, 20.0, True)
    # T_eff = 1.05; T_rec = 20 + (10/2 + 1) * 1.05 = 26.3; ETTR = (1/1.05) * (1 - 26.3/600).
    assert closed_form_ettr(m, 600.0, 0.0) == pytest.approx((1 / 1.05) * (1 - 26.3 / 600))
    leto = SystemModel("leto", 1.0, 1.01, 0.5, 32, 15.0, 35.0, False)
    eff = 1.01 + 0.5 / 32
    rec = 0.5 * (15 + 0.5 * eff) + 0.5 * (35 + 17 * eff)
    assert closed_form_ettr(leto, 600.0, 0.5) == pytest.approx((1 / eff) * (1 - rec / 600))


def test_same_seeds_same_numbers():
    cfg = parse_config(small())
    a, b = simulate(cfg), simulate(cfg)
    assert [s.per_seed for s in a.systems] == [s.per_seed for s in b.systems]
