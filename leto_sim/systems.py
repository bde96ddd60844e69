"""Per-system steady-state and recovery models: Leto, Gemini+ and checkpoint-restart.

Role: for one system, one fault-free iteration time T_iter (iteration.py) and one failure
process (MTTF M, HOF ratio h), say (a) how long each iteration takes in steady state, (b) which
iterations commit a checkpoint and what that stall costs, and (c) what one failure costs: the
downtime before training resumes and whether progress rolls back to the last usable
checkpoint.  ettr.py replays failure schedules through these objects; :meth:`oracle_terms`
gives the closed-form terms of the paper's ETTR prediction (Appendix C, Eqs. 6-8).

Calling contract: :func:`build_systems` returns one :class:`SystemModel` per configured system.
Every method is pure.  Assumptions (also in docs/SIM.md):

* Checkpoint stall: an iteration that commits a checkpoint (iteration k with k % I == 0) takes
  p * T_iter longer (the paper's normalized per-checkpoint cost p); others take the base time.
* A checkpoint becomes usable once the following iteration completes (its transfer finishes
  at that iteration's step), so a failure loses 1..I completed iterations plus the elapsed
  part of the one in flight: L = I/2 + 1 in expectation (the paper's Eq. 7).  We apply the same
  rule to asynchronous DCP checkpoints of checkpoint-restart (assumed: the paper gives none).
  ``commit_lag`` holds the rule (1); the measured synchronous DCP saves of validate.py use 0
  (usable when the save returns), so L = I/2 there.
* Gemini+ and checkpoint-restart recover every failure the same way (a HOF costs what an FF
  does): detection + init + load, then recompute since the last usable checkpoint.
* Leto recovers a HOF in place: detection + promotion of the shadow + reconstruction of lost
  pages, then redoes the interrupted iteration from its start (losing its elapsed part; RMU's
  finish-from-last-chunk, which saves part of an interrupted update, is not credited).  An FF
  goes through the fallback system's path at Leto's own FF interval.
* Leto's steady-state cost is RMU's update overhead (seconds per iteration) plus the
  fallback's checkpoint stall every FF interval.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import CheckpointSpec, LetoSpec, SimConfig
from .iteration import young_interval


@dataclass(frozen=True)
class SystemModel:
    """One system's steady state and failure costs, all in seconds."""
    name: str
    t_iter: float             # the reference (no fault tolerance) iteration time
    base: float               # a non-committing iteration of this system
    stall: float              # extra time of a committing iteration
    interval: int             # checkpoint interval in iterations
    hof_downtime: float       # failure -> training resumes, for a HOF
    ff_downtime: float        # same for an FF
    hof_rolls_back: bool      # does a HOF roll back to the last usable checkpoint?
    # Iterations after a commit before its checkpoint is usable: 1 for in-memory (Gemini) and
    # asynchronous saves (the transfer finishes at the next iteration's step), 0 for a
    # synchronous save (usable when the call returns; only the measured profiles have one).
    commit_lag: int = 1

    def cost(self, is_hof: bool) -> tuple[float, bool]:
        """(downtime, rolls_back) of one failure: the pure per-failure recovery cost."""
        if is_hof:
            return self.hof_downtime, self.hof_rolls_back
        return self.ff_downtime, True

    def duration(self, k: int) -> float:
        """Wall time of iteration k (1-based): the base, plus the stall when k commits."""
        return self.base + (self.stall if k % self.interval == 0 else 0.0)

    def elapsed(self, n: int) -> float:
        """Wall time of iterations 1..n run back to back (closed form of the sum of duration)."""
        return n * self.base + (n // self.interval) * self.stall

    def usable_checkpoint(self, completed: int) -> int:
        """The newest checkpoint usable once `completed` iterations have completed (0: the
        initial state): checkpoint k is usable once iteration k + commit_lag has completed."""
        return max(0, self.interval * ((completed - self.commit_lag) // self.interval))

    @property
    def t_eff(self) -> float:
        """Mean steady-state iteration time: T_eff = base + stall / I (Eqs. 7, 8)."""
        return self.base + self.stall / self.interval

    def oracle_terms(self, hof_ratio: float) -> tuple[float, float]:
        """(T_eff, mean T_rec per failure) of the paper's Eq. 6, mixing the classes by h:
        T_rec = downtime + L * T_eff with L = 1/2 in place and I/2 + 1 after a rollback (the
        paper's Eq. 7; I/2 for a synchronous save, commit_lag 0)."""
        eff = self.t_eff
        # completed iterations lost: lag..I+lag-1, (I-1)/2 + lag on average; + 1/2 in flight
        roll = self.interval / 2.0 + self.commit_lag
        hof = self.hof_downtime + (roll if self.hof_rolls_back else 0.5) * eff
        ff = self.ff_downtime + roll * eff
        return eff, hof_ratio * hof + (1.0 - hof_ratio) * ff


def round_interval(raw: float, cap: int | None = None) -> int:
    """Young's interval rounded to a whole number of iterations, at least 1, at most `cap`."""
    if math.isinf(raw):
        if cap is None:
            raise ValueError("an infinite interval needs a cap")
        return cap
    n = max(1, int(round(raw)))
    return min(n, cap) if cap is not None else n


def checkpoint_model(spec: CheckpointSpec, t_iter: float, mttf: float) -> SystemModel:
    """Gemini+ or checkpoint-restart: interval from Young's formula at the overall MTTF
    (every failure rolls back), unless the config pins it."""
    interval = spec.interval or round_interval(young_interval(spec.checkpoint_cost, mttf, t_iter))
    down = spec.detection + spec.init + spec.load
    return SystemModel(spec.name, t_iter, t_iter, spec.checkpoint_cost * t_iter, interval,
                       down, down, True)


def leto_model(spec: LetoSpec, fallback: CheckpointSpec, t_iter: float, mttf: float,
               hof_ratio: float) -> SystemModel:
    """Leto: FF interval from Young's formula at the FF MTTF M / (1 - h), capped at (and, at
    h = 1, equal to) the largest interval the config allows; the stall is the fallback's p
    times the reference T_iter (the same checkpoint mechanism on the same state)."""
    base = t_iter + spec.rmu_overhead
    ff_mttf = math.inf if hof_ratio >= 1.0 else mttf / (1.0 - hof_ratio)
    interval = spec.ff_interval or round_interval(
        young_interval(fallback.checkpoint_cost, ff_mttf, base), spec.max_ff_interval)
    hof_down = spec.detection + spec.promotion + spec.reconstruction
    ff_down = fallback.detection + fallback.init + fallback.load
    return SystemModel("leto", t_iter, base, fallback.checkpoint_cost * t_iter, interval,
                       hof_down, ff_down, False)


def build_systems(cfg: SimConfig, t_iter: float, mttf: float,
                  hof_ratio: float) -> list[SystemModel]:
    """One model per configured system, Leto first, at this MTTF and HOF ratio."""
    out = []
    if cfg.leto is not None:
        out.append(leto_model(cfg.leto, cfg.checkpointing[cfg.leto.ff_fallback], t_iter,
                              mttf, hof_ratio))
    out += [checkpoint_model(spec, t_iter, mttf) for spec in cfg.checkpointing.values()]
    return out
