"""benchmarks/recovery/run.py's budget rule: a system starts only with the time to finish, judged
by the longest run of its kind so far (else the reference's, which also calibrates), so that a
system that cannot finish is skipped -- and a --continue call measures it whole -- instead of
being stopped by the budget's timeout as a partial run (the H200 run of 2026-11-30 03:35 UTC:
leto-run restart + DCP started with 70 s left and a ~135 s need, and was cut at step 80)."""
from __future__ import annotations

from benchmarks.recovery.run import MIN_SYSTEM_S, system_fits, walls


def test_the_longest_run_of_the_same_kind_sets_the_need():
    w = {"ref": 130.3, "leto": 67.8, "dcp": 135.5}
    fits, why = system_fits(70, 45, "dcp", w)
    assert not fits and "70 s left" in why and "149 s" in why and "dcp" in why
    assert system_fits(150, 45, "dcp", w)[0]
    assert system_fits(80, 45, "leto", w)[0]              # 1.1 x 67.8 = 74.6 s


def test_a_first_system_of_its_kind_is_judged_by_the_reference_then_the_training_time():
    fits, why = system_fits(140, 45, "leto", {"ref": 130.0})
    assert not fits and "reference" in why               # 143 s needed
    fits, why = system_fits(60, 45, "leto", {})
    assert not fits and "1.5 x the 45 s of training" in why
    assert system_fits(68, 45, "leto", {})[0]
    assert not system_fits(MIN_SYSTEM_S - 1, 1, "leto", {})[0]


def test_walls_takes_the_longest_launch_per_mode_from_a_harness_result():
    res = {"reference": {"launch": {"wall_s": 130.3}},
           "systems": {"a": {"mode": "dcp", "launch": {"wall_s": 135.5}},
                       "b": {"mode": "dcp", "launch": {"wall_s": 70.4}},      # cut by the budget
                       "c": {"mode": "leto", "launch": {"wall_s": 67.8}}}}
    assert walls(res) == {"ref": 130.3, "dcp": 135.5, "leto": 67.8}
    assert walls({"systems": {}}) == {}
