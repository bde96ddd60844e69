"""The seeded Monte-Carlo failure process.

Role: draw one failure schedule -- arrival times in wall-clock seconds and, per failure, its
class (HOF: hardware-operable, recoverable in place; FF: fatal, needs other hardware) -- for a
horizon, an MTTF and a HOF ratio.

Calling contract: :func:`draw_schedule` is deterministic in its seed (numpy's PCG64 Generator,
explicit seed, nothing global).  Inter-arrival times are exponential with mean MTTF: failures
arrive at rate 1/MTTF in elapsed time, recovery included, as the paper's ETTR prediction
assumes (Appendix C).  Each failure draws a uniform u and is a HOF iff u < h; the schedule keeps
u, so schedules of the same seed at different HOF ratios are coupled (raising h turns some FFs
into HOFs and changes nothing else), which makes sweeps over h comparable seed by seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Schedule:
    """A failure schedule: sorted arrival times (s) and the per-failure class draw u."""
    times: np.ndarray
    class_draw: np.ndarray
    horizon: float

    def is_hof(self, hof_ratio: float) -> np.ndarray:
        """Boolean mask of HOFs at this ratio (u < h: h = 0 gives none, h = 1 gives all)."""
        return self.class_draw < hof_ratio

    def __len__(self) -> int:
        return int(self.times.size)


def draw_schedule(mttf: float, horizon: float, seed: int) -> Schedule:
    """Failures in [0, horizon): exponential inter-arrivals of mean `mttf`, seeded."""
    if not mttf > 0 or not horizon > 0:
        raise ValueError("mttf and horizon must be positive")
    rng = np.random.Generator(np.random.PCG64(seed))
    # Draw in chunks sized to the expected count (plus slack) so one call usually suffices.
    expect = horizon / mttf
    chunk = int(expect + 6.0 * np.sqrt(expect) + 16)
    gaps = rng.exponential(mttf, chunk)
    times = np.cumsum(gaps)
    while times[-1] < horizon:
        more = np.cumsum(rng.exponential(mttf, chunk)) + times[-1]
        times = np.concatenate([times, more])
    times = times[times < horizon]
    # Classes from a second stream of the same generator, drawn after the times.
    draw = rng.random(times.size)
    return Schedule(times, draw, horizon)


def seed_list(base_seed: int, seeds: int) -> list[int]:
    """The seeds of one experiment: base_seed, base_seed + 1, ... (explicit, reproducible)."""
    return [base_seed + k for k in range(seeds)]
