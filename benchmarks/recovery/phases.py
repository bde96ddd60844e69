"""train.py's optional instruments of a leto trainer's steps (`--phases`, `--profile`).

`Phases(device)` per step, `mark(name)` after each phase: wall and main-thread CPU seconds of
the phase and the caching allocator's new segments (each phase synchronized first).
`Profiler(out, rank)`: cProfile of the first two steps of the first trainer promoted on a rank
(`begin(promoted)` / `end(step)` around each step; `prof_<rank>_<step>.pstats` in `out`).
"""
from __future__ import annotations

import os
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Phases:
    """`--phases`: per phase of one step, wall and main-thread CPU seconds (a cold phase's
    lazy kernel loading and library set-up are CPU work; waiting for the device is not) and the
    caching allocator's new segments (cudaMalloc calls)."""

    def __init__(self, device: torch.device):
        self.device, self.rows = device, {}
        self.t, self.cpu, self.n = time.monotonic(), time.thread_time(), self._allocs()

    def _allocs(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_device_alloc", 0))

    def mark(self, name: str) -> None:
        sync(self.device)
        t, cpu, n = time.monotonic(), time.thread_time(), self._allocs()
        self.rows[name] = {"s": t - self.t, "cpu_s": cpu - self.cpu, "allocs": n - self.n}
        self.t, self.cpu, self.n = time.monotonic(), time.thread_time(), self._allocs()


class Profiler:
    """cProfile of a promoted trainer's first two steps; only the first trainer promoted on
    the rank (an earlier one's files are there) -- the profiler slows what it watches, so the
    later recoveries of the run are the ones to time."""

    STEPS = 2

    def __init__(self, out: str, rank: int):
        self.out, self.rank, self.done, self.prof = out, rank, 0, None
        self.first: bool | None = None        # decided at the first step after a promotion

    def begin(self, promoted: bool) -> None:
        if promoted and self.first is None:
            self.first = not any(n.startswith(f"prof_{self.rank}_")
                                 for n in os.listdir(self.out))
        if promoted and self.first and self.done < self.STEPS:
            import cProfile
            self.prof = cProfile.Profile()
            self.prof.enable()

    def end(self, step: int) -> None:
        if self.prof is not None:
            self.prof.disable()
            self.prof.dump_stats(os.path.join(self.out, f"prof_{self.rank}_{step}.pstats"))
            self.prof, self.done = None, self.done + 1
