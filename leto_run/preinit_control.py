"""The preinitialization controller in the agent (issue 21; docs/PREINIT.md): which level each
local shadow runs at, from what the device's driver reports, through the pure decisions of
`leto_run.preinit`.

Role: a small policy object the in-place recovery (`leto_run.inplace`) asks once a loop turn
(`decide`) and tells about recoveries (`after_recovery`) and injected level changes (`pin`).  It
never starts or kills a process: it returns the levels and the reason; `InplaceRecovery`
relaunches the shadows.

What it observes (GPU, through NVML: `leto_run.nvml`), per local rank's device, every
`TICK_S`: total and free bytes; the bytes the active holds (its process's; none where the driver
lists the shadow's pid and not the active's; everything on the device but the shadows where the
driver hides processes), kept over `WINDOW_S` for the peak and its trend (`preinit.peak_trend`;
the trend only once the active has completed `WARMUP_STEPS` steps in its role: the ramp of its
set-up is no trend); and what each shadow holds at its level, which refines the level costs
(the defaults are the H200 figures of docs/BENCHMARKS.md).  Without a driver (CPU) there is
nothing to observe: the shadows run at the policy's level, and only an injected `preinit`
(tests) moves them.

Rules beyond `preinit.choose_level`: the generation's levels go through
`preinit.generation_levels` (L3 is every shadow's or no one's); a step down sets the time the
raise hold counts from.

Calling contract: `decide(now, slots)` returns None (nothing to change, or nothing observed
yet) or (levels by rank, reason, warning); `last` then holds what that decision saw and each
rank's reason, kept levels included (for the `preinit_observed` event); `start_level(rank)` is
the level a shadow started now gets.  Single-threaded (the agent's loop).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque

from leto_run.preinit import (Level, LevelCosts, MemoryObservation, PreinitPolicy,
                              cap_after_reclaim, cap_after_recovery, choose_level,
                              generation_levels, peak_trend, reclaim_plan, warmup_room)
from leto_run.slot import RankSlot

TICK_S = 0.5                 # how often the devices are sampled
WINDOW_S = 30.0              # the active's peak and trend are taken over this window
WARMUP_STEPS = 3             # an active's first steps allocate its set-up: not a trend
MIB = 1 << 20
DEFAULT_COSTS = LevelCosts(l2=612 * MIB, l3=1170 * MIB)   # H200, docs/BENCHMARKS.md
RECLAIM_SLACK = 64 * MIB     # what cuda/lend_alloc.cpp waits for beyond the request (reclaim_slack)


class ShadowLevels:
    def __init__(self, policy: PreinitPolicy, nvml=None) -> None:
        self.policy, self.nvml = policy, nvml
        self.cap = policy.top
        self.costs = DEFAULT_COSTS
        self.last_down = -math.inf
        self.next_tick = 0.0
        self.samples: dict[int, deque] = {}          # rank -> (mono, active bytes)
        self.trend_samples: dict[int, deque] = {}    # rank -> (mono, active bytes), warm only
        self.trend_pid: dict[int, int | None] = {}   # rank -> the active they were taken of
        self.chosen: dict[int, Level] = {}           # rank -> the level decided last
        self.seen_costs: dict[Level, int] = {}
        # rank -> (its device, the latest observation, when)
        self.seen: dict[int, tuple[int, MemoryObservation, float]] = {}
        self.last: dict = {}                         # what the last decision saw and why

    # ---- what the in-place recovery tells it ---------------------------------------------
    def pin(self, level: Level) -> None:
        """An injected level change: from now on the policy is that level (tests, operators)."""
        self.policy = dataclasses.replace(self.policy, mode=Level(level).name)
        self.cap = self.policy.top
        self.chosen = {}
        self.next_tick = 0.0            # decide at the next turn
        self.last_down = -math.inf      # an explicit choice: no raise hold

    def after_recovery(self) -> None:
        """The paper's rule: a recovery resets the cap to the policy's level; the new shadows'
        level comes from the observations again."""
        self.cap = cap_after_recovery(self.policy)

    def start_level(self, rank: int) -> Level:
        return Level(min(self.chosen.get(rank, self.cap), self.cap, self.policy.top))

    def warmup_room(self, now: float, rank: int, level: Level) -> tuple[int, str] | None:
        """(bytes, why) the warm-up of the shadow of `rank` started `now` at `level` may take
        (`preinit.warmup_room` over the latest observation of its device, shared with the
        other ranks on that device), or None with nothing observed within `WINDOW_S` (no
        driver, no sample yet -- the job's first shadows start beside their actives -- or
        none lately: an old view says nothing of now)."""
        got = self.seen.get(rank)
        if got is None or now - got[2] > WINDOW_S:
            return None
        dev = got[0]
        return warmup_room([o for d, o, t in self.seen.values()
                            if d == dev and now - t <= WINDOW_S], self.policy, self.costs, level)

    # ---- the decision ----------------------------------------------------------------------
    def decide(self, now: float, slots: list[RankSlot]):
        if now < self.next_tick:
            return None
        self.next_tick = now + TICK_S
        current = {s.rank: Level[s.shadow.level] for s in slots if s.shadow is not None}
        if len(current) != len(slots):
            return None                  # a shadow is being started: decide once all are there
        obs = self._observe(now, slots) if self.nvml is not None else None
        if obs is None and self.nvml is not None:
            return None                  # a lost sample decides nothing
        if obs is None:
            chosen = {r: Level(min(self.policy.top, self.cap)) for r in current}
            why = {r: f"policy {self.policy.mode}" for r in current}
            warn = {r: False for r in current}
        else:
            chosen, why, warn = {}, {}, {}
            for r, o in obs.items():
                d = choose_level(o, self.policy, self.costs, current[r], self.cap,
                                 now - self.last_down)
                chosen[r], why[r], warn[r] = d.level, d.reason, d.warning
        self.last = {"levels": {r: lv.name for r, lv in current.items()}, "why": why,
                     "seen": {r: {"free": o.free, "active_peak": o.active_peak,
                                  "trend": round(o.trend)} for r, o in (obs or {}).items()}}
        ranks = sorted(chosen)
        levels, joint = generation_levels([chosen[r] for r in ranks])
        target = dict(zip(ranks, levels))
        self.chosen = target
        if target == current:
            return None
        if any(target[r] < current[r] for r in ranks):
            self.last_down = now
        changed = [r for r in ranks if target[r] != current[r]]
        reason = "; ".join(f"rank {r}: {why[r]}" for r in changed[:4])
        if joint != "every shadow at its device's level":
            reason += f"; {joint}"
        return target, reason, any(warn[r] for r in changed)

    def reclaim(self, now: float, slots: list[RankSlot], rank: int, request: int):
        """The active of `rank` could not allocate `request` bytes after torch released its
        cache: (levels by rank, reason) that free enough on its device, or (None, reason) when
        no level would (the OOM is the active's own) or nothing can be observed."""
        slot = next((s for s in slots if s.rank == rank), None)
        if self.nvml is None or slot is None or slot.shadow is None:
            return None, "no shadow on this device, or no driver to observe it"
        from leto_run.nvml import NvmlError
        try:
            dev = self.nvml.device_of(slot.local_rank, slot.device_uuid)
            total, free = self.nvml.memory(dev)
            obs = self._one(now, slot, total, free, self.nvml.process_bytes(dev))
        except NvmlError as e:
            return None, f"the device cannot be observed ({e})"
        if free >= request + RECLAIM_SLACK:
            return None, "the request fits already (freed since it failed)"
        current = {s.rank: Level[s.shadow.level] for s in slots if s.shadow is not None}
        d = reclaim_plan(request + RECLAIM_SLACK, obs, self.costs, current[rank])
        if d.change != "down":
            return None, d.reason
        ranks = sorted(current)
        levels, _ = generation_levels([d.level if r == rank else current[r] for r in ranks])
        self.cap = cap_after_reclaim(self.cap, d.level)
        self.last_down = now
        self.chosen = dict(zip(ranks, levels))
        return dict(self.chosen), d.reason

    def _observe(self, now: float, slots: list[RankSlot]) -> dict[int, MemoryObservation] | None:
        from leto_run.nvml import NvmlError
        out = {}
        try:
            for s in slots:
                dev = self.nvml.device_of(s.local_rank, s.device_uuid)
                total, free = self.nvml.memory(dev)
                procs = self.nvml.process_bytes(dev)
                out[s.rank] = self._one(now, s, total, free, procs)
                self.seen[s.rank] = (dev, out[s.rank], now)
        except NvmlError:
            return None                  # this sample is lost; the next one may not be
        return out

    def _one(self, now: float, s: RankSlot, total: int, free: int,
             procs: dict[int, int]) -> MemoryObservation:
        sh, act = s.shadow, s.active
        held = procs.get(sh.proc.pid) if sh is not None else None
        if held is not None and sh.ready:
            self._learn(Level[sh.level], held)
        if act is not None and act.proc.pid in procs:
            active = procs[act.proc.pid]
        elif held is not None:
            active = 0                   # the driver lists our pids, and not the active's: it
            # holds nothing on the device (no context yet)
        else:
            shadow = held if held is not None else self.costs.of(Level[sh.level]) if sh else 0
            active = max(0, total - free - shadow)
        q = self.samples.setdefault(s.rank, deque())
        q.append((now, active))
        t = self.trend_samples.setdefault(s.rank, deque())
        pid = act.proc.pid if act is not None else None
        if self.trend_pid.get(s.rank) != pid:
            t.clear()                    # a new active: its predecessor's growth is not its own
            self.trend_pid[s.rank] = pid
        if _warm(act):
            t.append((now, active))
        for d in (q, t):
            while d and d[0][0] < now - WINDOW_S:
                d.popleft()
        return MemoryObservation(total=total, free=min(free, total),
                                 active_peak=max(b for _, b in q), trend=peak_trend(list(t)),
                                 trend_span=t[-1][0] - t[0][0] if t else 0.0,
                                 shadows=1 if sh is not None else 0, active=active)

    def _learn(self, level: Level, held: int) -> None:
        if level < Level.L2:
            return
        self.seen_costs[level] = max(self.seen_costs.get(level, 0), held)
        l2 = self.seen_costs.get(Level.L2, self.costs.l2)
        l3 = max(l2, self.seen_costs.get(Level.L3, self.costs.l3))
        self.costs = LevelCosts(l2=l2, l3=l3)


def _warm(act) -> bool:
    """The active has completed `WARMUP_STEPS` steps in its role.  Before, its memory ramps up
    from nothing (activations, the optimizer's lazily created state, the caching allocator's
    segments) within seconds: a slope drawn from that ramp, projected over the horizon, reads a
    job that fits as one about to run out and takes the shadows down for nothing.  Its peak
    counts from the first sample; its trend only from here."""
    return (act is not None and act.first_step is not None and act.step is not None
            and act.step - act.first_step >= WARMUP_STEPS)
