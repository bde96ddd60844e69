"""The preinitialization controller's decisions (issue 21; paper §6): how far each shadow may
preinitialize, from memory observations of its device.  Pure functions: (observation, policy,
state) -> level + reason; no processes, clocks or I/O, so every rule is unit-tested directly and
the reason is logged verbatim with each transition.

Levels (a shadow's GPU footprint grows with each):

| level | the shadow has                                            | GPU memory it holds      |
|-------|-----------------------------------------------------------|--------------------------|
| L0    | nothing (not started, or reclaimed and not yet relaunched) | none                     |
| L1    | process started, imports done, no CUDA context             | none                     |
| L2    | + CUDA context, kernels loaded, allocator warm             | context + modules        |
| L3    | + the process group / communicators of its generation      | + communicator buffers   |

The rules:
- `choose_level`: the highest level, at most the policy's (`auto` = L3, or a pinned L1|L2|L3)
  and at most the *cap*, at which the device keeps `margin` bytes free after the active's
  projected growth (its peak trend over `horizon_s`, or over as many seconds as the trend's
  samples span, if fewer).  Going down happens at once (before the
  active's peak reaches the shadow's memory); going up waits until `raise_hold_s` passed since
  the last step down and needs twice the margin, so a level is not rebuilt and reclaimed in a
  loop.  A pinned level that does not fit runs at the level that does, with a warning reason.
- `reclaim_plan`: the active's allocation failed after torch's own cache release; the lowest
  drop of the local shadows that frees enough for the request -- or none (the OOM is the
  active's own: no shadow level would make it fit, so the shadows keep their level).
- After a reclamation the cap is the level the shadows were relaunched at (`cap_after_reclaim`):
  further reclamations only lower it until the next in-place recovery, which resets it to the
  policy's level (`cap_after_recovery`); the new shadows' level then comes from the observed peak.

Byte figures are per device.  L1 holds no GPU memory, so it always fits: a shadow is never
removed for memory alone (recovery from L1 still avoids the checkpoint and the recomputation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

POLICIES = ("auto", "L1", "L2", "L3")


class Level(IntEnum):
    L0 = 0
    L1 = 1
    L2 = 2
    L3 = 3


@dataclass(frozen=True)
class LevelCosts:
    """Resident GPU bytes of one shadow at L2 and at L3 (measured on the device: the context
    and loaded modules; plus the communicators)."""
    l2: int
    l3: int

    def __post_init__(self) -> None:
        if not 0 <= self.l2 <= self.l3:
            raise ValueError(f"level costs must satisfy 0 <= L2 <= L3, got {self.l2}, {self.l3}")

    def of(self, level: Level) -> int:
        return {Level.L0: 0, Level.L1: 0, Level.L2: self.l2, Level.L3: self.l3}[Level(level)]


@dataclass(frozen=True)
class PreinitPolicy:
    mode: str = "auto"              # auto | L1 | L2 | L3
    margin: int = 1 << 30           # bytes the device keeps free beyond the projection
    horizon_s: float = 30.0         # how far the active's peak trend is projected
    raise_hold_s: float = 60.0      # no raise sooner than this after a step down

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"preinit policy {self.mode!r} is not one of {', '.join(POLICIES)}")
        if self.margin < 0 or not (math.isfinite(self.horizon_s) and self.horizon_s >= 0) \
                or not (math.isfinite(self.raise_hold_s) and self.raise_hold_s >= 0):
            raise ValueError("margin, horizon_s and raise_hold_s must be finite and >= 0")

    @property
    def top(self) -> Level:
        return Level.L3 if self.mode == "auto" else Level[self.mode]


@dataclass(frozen=True)
class MemoryObservation:
    """One device, now: `free` as the driver reports it (cudaMemGetInfo: every process's
    memory counted), `shadows` the local shadows on it and their current level, the active's
    peak (reserved bytes, over the controller's window) and its trend (bytes/s, `peak_trend`)
    with the seconds of samples it was drawn from (`trend_span`)."""
    total: int
    free: int
    active_peak: int
    trend: float = 0.0
    shadows: int = 1
    trend_span: float = math.inf    # seconds of samples behind the trend
    active: int | None = None       # what the active holds now (None: unknown, counted as 0)

    def __post_init__(self) -> None:
        if self.total <= 0 or not 0 <= self.free <= self.total or self.active_peak < 0 \
                or self.shadows < 0 or not math.isfinite(self.trend) \
                or not self.trend_span >= 0 or (self.active is not None and self.active < 0):
            raise ValueError(f"impossible memory observation: {self}")


@dataclass(frozen=True)
class LevelDecision:
    level: Level
    change: str                     # down | up | hold
    reason: str
    warning: bool = False           # a pinned policy the device cannot hold


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def projection_s(obs: MemoryObservation, horizon_s: float) -> float:
    """How far ahead the trend is projected: the horizon, but never further than the samples
    behind it reach back (a slope seen for 1 s says nothing about the next 30 s)."""
    return min(horizon_s, obs.trend_span)


def headroom_at(obs: MemoryObservation, costs: LevelCosts, current: Level, level: Level,
                horizon_s: float) -> float:
    """Bytes the device would keep free with every local shadow at `level` instead of
    `current`, after the active's projected growth over `projection_s` (a falling trend counts
    0: memory the active released may come back at once)."""
    freed = obs.shadows * (costs.of(current) - costs.of(level))
    return obs.free + freed - max(0.0, obs.trend) * projection_s(obs, horizon_s)


def choose_level(obs: MemoryObservation, policy: PreinitPolicy, costs: LevelCosts,
                 current: Level, cap: Level, since_down_s: float) -> LevelDecision:
    """The level the local shadows should be at now (module docstring: the rules)."""
    ceiling = Level(min(policy.top, cap))
    best = Level.L1
    for lv in (Level.L3, Level.L2):
        if lv <= ceiling and headroom_at(obs, costs, current, lv, policy.horizon_s) \
                >= policy.margin:
            best = lv
            break
    room = headroom_at(obs, costs, current, best, policy.horizon_s)
    why = (f"{_gib(room)} would stay free at {best.name} (margin {_gib(policy.margin)}; "
           f"active peak {_gib(obs.active_peak)}, trend {_gib(obs.trend)}/s over "
           f"{projection_s(obs, policy.horizon_s):.3g} s)")
    pinned_short = policy.mode != "auto" and best < policy.top
    warn = (f"preinit {policy.mode} does not fit this device now; the shadow runs at {best.name}: "
            if pinned_short and cap >= policy.top else "")
    if best < current:
        return LevelDecision(best, "down", f"{warn}{current.name} -> {best.name}: {why}",
                             bool(warn))
    if best > current:
        if since_down_s < policy.raise_hold_s:
            return LevelDecision(current, "hold", f"{warn}{current.name} held: {best.name} "
                                 f"would fit, but the last step down was {since_down_s:.0f} s "
                                 f"ago (< {policy.raise_hold_s:g} s)", bool(warn))
        up = [lv for lv in range(best, current, -1) if headroom_at(
            obs, costs, current, Level(lv), policy.horizon_s) >= 2 * policy.margin]
        if not up:
            return LevelDecision(current, "hold", f"{warn}{current.name} held: {best.name} "
                                 f"fits only within twice the margin ({why})", bool(warn))
        to = Level(up[0])
        room = headroom_at(obs, costs, current, to, policy.horizon_s)
        return LevelDecision(to, "up", f"{warn}{current.name} -> {to.name}: {_gib(room)} would "
                             f"stay free (twice the margin {_gib(policy.margin)} needed to "
                             "raise)", bool(warn))
    return LevelDecision(current, "hold", f"{warn}{current.name} held: {why}", bool(warn))


def warmup_room(device: Sequence[MemoryObservation], policy: PreinitPolicy, costs: LevelCosts,
                level: Level) -> tuple[int, str]:
    """Bytes each shadow started now at `level` on one device may take for its warm-up
    (leto_runtime/warmup.py: held for a second or two, given back after), and why, from the
    latest observation of every rank on that device (each its own active; `free` is the
    device's): the free memory less every active's regrowth to its peak over the window (what
    it released between steps comes back at its next one; a promoted active grows to its
    predecessor's peak) and its projected growth, the margin, and each new shadow's level;
    split among the device's ranks (all their shadows may start at once); never negative."""
    n = max(1, len(device))
    free = min(o.free for o in device) if device else 0
    regrow = sum(max(0, o.active_peak - (o.active or 0)) for o in device)
    grow = sum(max(0.0, o.trend) * projection_s(o, policy.horizon_s) for o in device)
    room = free - regrow - grow - policy.margin - n * costs.of(level)
    share = max(0, int(room // n))
    why = (f"{_gib(free)} free, less the active's regrowth to its peak {_gib(regrow)}, its "
           f"growth {_gib(grow)}, the margin {_gib(policy.margin)} and {level.name} "
           f"{_gib(costs.of(level))}" + (f", over {n} ranks on the device" if n > 1 else ""))
    return share, why


def reclaim_plan(request: int, obs: MemoryObservation, costs: LevelCosts,
                 current: Level) -> LevelDecision:
    """The active could not allocate `request` bytes (torch's cache already released): the
    highest level of the local shadows at which the request fits, or `current` with the reason
    why no drop helps (then the OOM is the active's own and reaches the script)."""
    for lv in sorted((lv for lv in Level if Level.L1 <= lv < current), reverse=True):
        if headroom_at(obs, costs, current, lv, 0.0) >= request:
            return LevelDecision(lv, "down", f"the active needs {_gib(request)} with "
                                 f"{_gib(obs.free)} free: {current.name} -> {lv.name} frees "
                                 f"{_gib(obs.shadows * (costs.of(current) - costs.of(lv)))}")
    most = obs.shadows * costs.of(current)
    return LevelDecision(current, "hold", f"the active needs {_gib(request)} with "
                         f"{_gib(obs.free)} free; the shadows hold {_gib(most)}, so no "
                         "reclamation makes it fit: the out-of-memory error is the "
                         "active's own")


def generation_levels(chosen: Sequence[Level]) -> tuple[list[Level], str]:
    """The levels the shadows of one generation take, from each device's choice (rank order).
    L3 is the generation's process group, which forms only when every rank's shadow joins: with
    one shadow below L3 the others would wait in the group's formation (and time out), so then
    no shadow goes beyond L2; L1 and L2 are each device's own."""
    low = [r for r, lv in enumerate(chosen) if lv < Level.L3]
    if not low or len(low) == len(chosen):
        return [Level(lv) for lv in chosen], "every shadow at its device's level"
    out = [Level(min(lv, Level.L2)) for lv in chosen]
    shown = ", ".join(str(r) for r in low[:8]) + (" ..." if len(low) > 8 else "")
    return out, (f"L3 needs every rank's shadow in the generation's group; rank(s) {shown} "
                 "cannot hold it, so every shadow stays at L2 at most")


def cap_after_reclaim(cap: Level, relaunched_at: Level) -> Level:
    """Further reclamations can only lower the level until the next recovery."""
    return Level(min(cap, relaunched_at))


def cap_after_recovery(policy: PreinitPolicy) -> Level:
    return policy.top


def peak_trend(samples: Sequence[tuple[float, int]]) -> float:
    """Least-squares slope (bytes/s) of the active's peak over (mono, bytes) samples; 0 with
    fewer than two distinct times."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mb = sum(b for _, b in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mt) * (b - mb) for t, b in samples) / var
