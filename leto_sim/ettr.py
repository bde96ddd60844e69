"""ETTR by Monte-Carlo timeline simulation, and the closed-form prediction used as an oracle.

Role: replay a failure schedule (failures.py) through one system model (systems.py) over the
horizon, iteration by iteration in closed form between failures, and measure ETTR as the
paper defines it (§8.1): ETTR = T_ref(i) / T_eval(i) for the run's last completed iteration i,
with T_ref(i) = i * T_iter (the reference run has no fault tolerance and no failures) and
T_eval(i) the wall time from the first iteration's start to iteration i's completion.  Over
seeds it reports the mean and a Student-t confidence interval.  :func:`closed_form_ettr` is the
paper's prediction (Appendix C, Eq. 6): ETTR = (T_iter / T_eff) * (1 - T_rec / MTTF).

Calling contract: :func:`simulate_run`, :func:`time_to_complete` (a fixed iteration count,
as the recovery harness runs; used by validate.py) and :func:`closed_form_ettr` are pure;
:func:`simulate` runs a whole config (optionally overriding MTTF, HOF ratio and seed count)
and returns a :class:`SimResult`.  Same config and seeds, same numbers.

Timeline rules (documented in docs/SIM.md): a failure during a recovery restarts the recovery
from that failure (the progress to recover is unchanged; an FF there still rolls back); the run
ends at the horizon, and ETTR is measured at the last iteration completed before it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config import SimConfig
from .failures import Schedule, draw_schedule, seed_list
from .iteration import IterationBreakdown, iteration_time
from .systems import SystemModel, build_systems


@dataclass(frozen=True)
class RunResult:
    """One seed's timeline: last completed iteration, its completion time, failure counts."""
    iterations: int
    t_eval: float
    t_ref: float
    failures: int
    hofs: int

    @property
    def ettr(self) -> float:
        return self.t_ref / self.t_eval if self.t_eval > 0 else 0.0


@dataclass(frozen=True)
class SystemResult:
    """One system over all seeds: mean ETTR, its CI, the closed-form oracle and the knobs."""
    name: str
    interval: int
    t_eff: float
    mean: float
    ci_low: float
    ci_high: float
    oracle: float
    per_seed: tuple[float, ...] = field(repr=False)


@dataclass(frozen=True)
class SimResult:
    """A whole simulation: the iteration breakdown, the failure process and each system."""
    name: str
    iteration: IterationBreakdown
    mttf: float
    hof_ratio: float
    seeds: int
    horizon: float
    systems: tuple[SystemResult, ...]


def _completed_by(m: SystemModel, done: int, start: float, stop: float) -> int:
    """Largest n >= done whose iterations done+1..n, started at `start`, end by `stop`."""
    budget = m.elapsed(done) + (stop - start)
    if stop <= start:
        return done
    # elapsed(n) is within one stall of n * t_eff, so the estimate is off by a few at most.
    n = max(done, int(budget / m.t_eff))
    while n > done and m.elapsed(n) > budget:
        n -= 1
    while m.elapsed(n + 1) <= budget:
        n += 1
    return n


def simulate_run(m: SystemModel, schedule: Schedule, hof: np.ndarray) -> RunResult:
    """Replay one failure schedule through one system; `hof` is the per-failure class mask."""
    start = 0.0            # when the in-flight iteration (done + 1) started or will start
    done = 0               # completed iterations of the current training state
    ckpt = 0               # newest usable checkpoint (iteration 0: the initial state)
    last_k, last_t = 0, 0.0  # the most recent completion event (index, wall time)
    hofs = 0
    for tf, is_hof in zip(schedule.times.tolist(), hof.tolist()):
        hofs += bool(is_hof)
        if tf > start:     # training was running: bank the iterations completed before tf
            n = _completed_by(m, done, start, tf)
            if n > done:
                last_k, last_t = n, start + m.elapsed(n) - m.elapsed(done)
                # checkpoint k is usable once iteration k + commit_lag has completed
                ckpt = max(ckpt, m.usable_checkpoint(n))
                done = n
        down, rolls_back = m.cost(bool(is_hof))
        if rolls_back:
            done = ckpt
        start = tf + down  # a failure inside a recovery restarts it from tf
    n = _completed_by(m, done, start, schedule.horizon)
    if n > done:
        last_k, last_t = n, start + m.elapsed(n) - m.elapsed(done)
    return RunResult(last_k, last_t, last_k * m.t_iter, len(schedule), hofs)


def time_to_complete(m: SystemModel, times, hof, iterations: int) -> float:
    """Wall time at which iteration `iterations` completes under the failures at `times`
    (seconds from the first iteration's start; `hof` their class mask), by the same timeline
    rules as :func:`simulate_run`.  This is how the recovery harness runs a system: a fixed
    iteration count, not a horizon; failures after the last completion do not count."""
    start, done, ckpt = 0.0, 0, 0
    for tf, is_hof in zip(list(times), list(hof)):
        if tf > start:
            n = _completed_by(m, done, start, tf)
            if n >= iterations:
                break
            if n > done:
                ckpt = max(ckpt, m.usable_checkpoint(n))
                done = n
        down, rolls_back = m.cost(bool(is_hof))
        if rolls_back:
            done = ckpt
        start = tf + down
    return start + m.elapsed(iterations) - m.elapsed(done)


def closed_form_ettr(m: SystemModel, mttf: float, hof_ratio: float) -> float:
    """The paper's Eq. 6 with the classes mixed by h: (T_iter/T_eff) * (1 - T_rec/MTTF).
    Valid under its assumptions (T_rec << MTTF, no overlapping failures, uniform arrivals, a
    long run); clamped at 0 where recovery outlasts the MTTF."""
    eff, rec = m.oracle_terms(hof_ratio)
    return max(0.0, (m.t_iter / eff) * (1.0 - rec / mttf))


def t_quantile(df: int, p: float = 0.975) -> float:
    """Student-t quantile by the Cornish-Fisher expansion around the normal quantile (good to
    ~1e-3 for df >= 3, exact enough for a CI half-width; avoids depending on scipy)."""
    z = {0.975: 1.959963984540054, 0.995: 2.5758293035489}[p]
    d = float(df)
    return (z + (z**3 + z) / (4 * d) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * d**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * d**3))


def mean_ci(values: list[float], p: float = 0.975) -> tuple[float, float, float]:
    """(mean, low, high): a two-sided 95% Student-t interval over the seeds' values."""
    a = np.asarray(values, dtype=float)
    mean = float(a.mean())
    if a.size < 2:
        return mean, mean, mean
    half = t_quantile(a.size - 1, p) * float(a.std(ddof=1)) / math.sqrt(a.size)
    return mean, mean - half, mean + half


def simulate(cfg: SimConfig, *, mttf: float | None = None, hof_ratio: float | None = None,
             seeds: int | None = None) -> SimResult:
    """Run every system of `cfg` over the same seeded schedules (common random numbers, so
    systems are compared on identical failures) and summarize ETTR per system."""
    f = cfg.failures
    mttf = f.mttf if mttf is None else mttf
    h = f.hof_ratio if hof_ratio is None else hof_ratio
    n_seeds = f.seeds if seeds is None else seeds
    it = iteration_time(cfg.workload)
    models = build_systems(cfg, it.total, mttf, h)
    schedules = [draw_schedule(mttf, f.horizon, s) for s in seed_list(f.base_seed, n_seeds)]
    results = []
    for m in models:
        ettrs = [simulate_run(m, s, s.is_hof(h)).ettr for s in schedules]
        mean, lo, hi = mean_ci(ettrs)
        results.append(SystemResult(m.name, m.interval, m.t_eff, mean, lo, hi,
                                    closed_form_ettr(m, mttf, h), tuple(ettrs)))
    return SimResult(cfg.name, it, mttf, h, n_seeds, f.horizon, tuple(results))
