"""The agent's preinitialization controller (`leto_run.preinit_control.ShadowLevels`) over the
driver's figures, against a device simulator that keeps its own books (the same oracle as
tests/unit/test_preinit.py): the active's memory grows towards the device's size and back; the
controller's levels, applied to the simulated shadows, never let the device run out, and a fixed
L3 shadow does.  Also: what a shadow at a level holds refines the level costs; a lost sample
decides nothing; the ramp of an active's first steps (its set-up) is no trend, and a new
active's trend starts afresh; a pinned (injected) level applies at once; without a driver (CPU)
the shadows run at the policy's level.  The NVML binding itself runs on the GPU
(tests/gpu/test_preinit_gpu.py).
"""
from __future__ import annotations

from types import SimpleNamespace as NS

from leto_run.nvml import NvmlError
from leto_run.preinit import Level, PreinitPolicy
from leto_run.preinit_control import DEFAULT_COSTS, RECLAIM_SLACK, ShadowLevels

GIB = 1 << 30


class Device:
    """Simulated GPUs, one per local rank: what each pid holds on each; the figures NVML would
    report."""

    def __init__(self, total: int = 80 * GIB) -> None:
        self.total, self.held, self.fail = total, {0: {}}, False

    def physical(self, local_rank: int) -> int:
        return local_rank

    def device_of(self, local_rank: int, uuid: str | None) -> int:
        return int(uuid[4:]) if uuid else self.physical(local_rank)

    def memory(self, index: int):
        if self.fail:
            raise NvmlError("GPU is lost")
        return self.total, max(0, self.total - sum(self.held[index].values()))

    def process_bytes(self, index: int):
        return dict(self.held[index])

    def oom(self) -> bool:
        return any(sum(h.values()) > self.total for h in self.held.values())


def _slots(levels: dict[int, str]):
    return [NS(rank=r, local_rank=r, active=NS(proc=NS(pid=100 + r), first_step=0, step=10),
               device_uuid=None,
               shadow=NS(proc=NS(pid=200 + r), level=lv, ready=True))
            for r, lv in levels.items()]


def test_the_shadow_steps_down_before_the_active_s_peak_and_back_after():
    dev, now = Device(), 0.0
    ctl = ShadowLevels(PreinitPolicy(margin=GIB, horizon_s=10, raise_hold_s=20), nvml=dev)
    slots = _slots({0: "L3"})
    fixed_oom = False
    seen = []
    for k in range(400):
        now = k * 1.0
        active = int((70 + 9.2 * min(k, 200 - k if k < 200 else 0) / 100) * GIB) if k < 200 \
            else 70 * GIB
        dev.held = {0: {100: active, 200: DEFAULT_COSTS.of(Level[slots[0].shadow.level])}}
        fixed_oom |= active + DEFAULT_COSTS.l3 > dev.total
        assert not dev.oom(), f"t={now}: the device ran out with the shadow at {slots[0].shadow.level}"
        d = ctl.decide(now, slots)
        if d is not None:
            levels, reason, _ = d
            assert reason
            slots[0].shadow.level = levels[0].name
            seen.append(levels[0].name)
    assert fixed_oom, "the workload must not fit beside a fixed L3 shadow"
    assert "L1" in seen or "L2" in seen, seen
    assert slots[0].shadow.level == "L3", f"back up after the peak: {seen}"
    # a kept level is explained too: what the last sample saw, and the reason
    assert ctl.last["levels"] == {0: "L3"} and "L3 held" in ctl.last["why"][0], ctl.last
    assert ctl.last["seen"][0]["free"] == dev.total - 70 * GIB - DEFAULT_COSTS.l3, ctl.last


def test_what_a_shadow_holds_refines_the_costs_and_a_lost_sample_decides_nothing():
    dev = Device()
    ctl = ShadowLevels(PreinitPolicy(), nvml=dev)
    slots = _slots({0: "L3"})
    dev.held = {0: {100: 10 * GIB, 200: 2 * GIB}}
    assert ctl.decide(0.0, slots) is None
    assert ctl.costs.l3 == 2 * GIB and ctl.costs.l2 == DEFAULT_COSTS.l2
    dev.fail = True
    assert ctl.decide(10.0, slots) is None


def test_one_device_below_l3_keeps_every_shadow_below_it():
    dev = Device()
    l3 = DEFAULT_COSTS.l3                                    # rank 0's device is nearly full
    dev.held = {0: {100: int(78.5 * GIB), 200: l3}, 1: {101: 10 * GIB, 201: l3}}
    ctl = ShadowLevels(PreinitPolicy(), nvml=dev)
    levels, reason, warn = ctl.decide(0.0, _slots({0: "L3", 1: "L3"}))
    assert levels[0] == Level.L1 and levels[1] == Level.L2, levels
    assert "every shadow stays at L2 at most" in reason and not warn


def test_a_pinned_level_applies_at_once_and_without_a_driver_the_policy_s():
    ctl = ShadowLevels(PreinitPolicy(mode="auto"), nvml=None)
    slots = _slots({0: "L3", 1: "L3"})
    assert ctl.decide(0.0, slots) is None and ctl.start_level(0) == Level.L3
    ctl.pin(Level.L1)
    levels, reason, warn = ctl.decide(0.0, slots)
    assert levels == {0: Level.L1, 1: Level.L1} and "policy L1" in reason and not warn
    assert ctl.start_level(1) == Level.L1


def test_a_pinned_l3_that_does_not_fit_runs_lower_with_a_warning():
    dev = Device()
    dev.held = {0: {100: int(79.5 * GIB)}}
    ctl = ShadowLevels(PreinitPolicy(mode="L3"), nvml=dev)
    levels, reason, warn = ctl.decide(0.0, _slots({0: "L3"}))
    assert levels[0] < Level.L3 and warn and "does not fit" in reason


def test_a_pinned_raise_is_not_held_back_by_the_last_automatic_step_down():
    dev = Device()
    dev.held = {0: {100: 10 * GIB}}
    ctl = ShadowLevels(PreinitPolicy(raise_hold_s=600), nvml=dev)
    slots = _slots({0: "L3"})
    ctl.pin(Level.L1)
    levels, _, _ = ctl.decide(0.0, slots)
    slots[0].shadow.level = levels[0].name
    ctl.pin(Level.L2)
    levels, reason, _ = ctl.decide(1.0, slots)
    assert levels == {0: Level.L2}, reason


def test_a_reclaim_frees_just_enough_and_caps_until_the_next_recovery():
    dev = Device()
    l3 = DEFAULT_COSTS.l3
    dev.held = {0: {100: 70 * GIB, 200: l3}}
    ctl = ShadowLevels(PreinitPolicy(), nvml=dev)
    slots = _slots({0: "L3"})
    free = dev.total - 70 * GIB - l3
    levels, reason = ctl.reclaim(0.0, slots, 0,
                                 free + DEFAULT_COSTS.l3 - DEFAULT_COSTS.l2 - RECLAIM_SLACK)
    assert levels == {0: Level.L2}, reason              # L2 frees enough: not L1
    assert ctl.start_level(0) == Level.L2 and ctl.cap == Level.L2
    levels, reason = ctl.reclaim(1.0, slots, 0, free + l3 + GIB)
    assert levels is None and "the active's own" in reason     # no level makes it fit
    ctl.after_recovery()
    assert ctl.cap == Level.L3


def test_a_request_that_fits_by_now_lowers_nothing():
    dev = Device()
    dev.held = {0: {100: 10 * GIB, 200: DEFAULT_COSTS.l3}}
    ctl = ShadowLevels(PreinitPolicy(), nvml=dev)
    levels, reason = ctl.reclaim(0.0, _slots({0: "L3"}), 0, GIB)
    assert levels is None and "fits already" in reason and ctl.cap == Level.L3


def test_an_active_the_driver_does_not_list_beside_its_listed_shadow_holds_nothing():
    """Another process's memory (here 60 GiB of a stranger, pid 999) is not the active's when the
    driver lists pids: only where it hides them is everything but the shadows the active's."""
    dev = Device()
    ctl = ShadowLevels(PreinitPolicy(), nvml=dev)
    slots = _slots({0: "L3"})
    dev.held = {0: {200: DEFAULT_COSTS.l3, 999: 60 * GIB}}           # the active has no context
    ctl.decide(0.0, slots)
    assert ctl.last["seen"][0]["active_peak"] == 0, ctl.last
    hidden = Device()
    hidden.process_bytes = lambda index: {}                          # a driver that hides pids
    hidden.held = dev.held
    ctl = ShadowLevels(PreinitPolicy(), nvml=hidden)
    ctl.decide(0.0, slots)
    assert ctl.last["seen"][0]["active_peak"] == 60 * GIB, ctl.last


def test_a_device_is_observed_by_the_uuid_its_active_reported_not_its_cuda_ordinal():
    """CUDA numbers devices fastest first by default, NVML in PCI order: local rank 0's
    device may be NVML's 1.  Here NVML's device 0 is nearly full and device 1 roomy."""
    dev = Device()
    l3 = DEFAULT_COSTS.l3
    dev.held = {0: {999: int(79.5 * GIB)}, 1: {100: 10 * GIB, 200: l3}}
    slots = _slots({0: "L3"})
    by_ordinal = ShadowLevels(PreinitPolicy(), nvml=dev).decide(0.0, slots)
    assert by_ordinal is not None and by_ordinal[0][0] < Level.L3       # the wrong device
    slots[0].device_uuid = "GPU-1"
    ctl = ShadowLevels(PreinitPolicy(), nvml=dev)
    assert ctl.decide(0.0, slots) is None                               # L3 fits on its own
    assert ctl.last["seen"][0]["free"] == dev.total - 10 * GIB - l3, ctl.last


def test_an_active_s_set_up_ramp_is_no_trend_and_a_new_active_starts_afresh():
    """Seen on an H100 (recovery harness, 2026-12-06): an active that filled 18 of 80 GiB in its
    first steps had a slope of 6.6 GiB/s, which over the 30 s horizon read as 199 GiB of
    growth, and the shadow went to L1 for nothing.  Its warm-up steps now set its peak only, a
    trend is projected no further than its samples reach back, and growth during training
    still takes the shadow down before the device runs out (here 18 GiB of set-up on a 25 GiB
    device, then 6 GiB of growth that does not fit beside an L3 shadow)."""
    def run(grow_from_step: int | None, promote_at: float | None = None):
        dev = Device(total=25 * GIB)
        ctl = ShadowLevels(PreinitPolicy(margin=GIB, horizon_s=30, raise_hold_s=60), nvml=dev)
        slots = _slots({0: "L3"})
        act = slots[0].active
        moves, set_up_from = [], 0
        for k in range(120):                              # 0.5 s samples and steps
            now = k * 0.5
            act.step = k
            if promote_at is not None and now == promote_at:   # a promoted shadow: new pid,
                act.proc.pid, act.first_step, set_up_from = 300, k, k   # its set-up again
            held = 18 * GIB * min(k - set_up_from, 2) // 2         # set-up: two steps
            if grow_from_step is not None:
                held += GIB // 4 * min(max(k - grow_from_step, 0), 24)
            dev.held = {0: {act.proc.pid: held,
                            200: DEFAULT_COSTS.of(Level[slots[0].shadow.level])}}
            assert not dev.oom(), (now, moves)
            d = ctl.decide(now, slots)
            if d is not None:
                slots[0].shadow.level = d[0][0].name
                moves.append((now, d[0][0].name, d[1]))
        return moves, ctl

    moves, ctl = run(grow_from_step=None)
    assert moves == [], moves
    assert ctl.last["seen"][0]["active_peak"] == 18 * GIB and ctl.last["seen"][0]["trend"] == 0
    moves, _ = run(grow_from_step=None, promote_at=40.0)   # the promoted trainer sets up again
    assert moves == [], moves
    moves, _ = run(grow_from_step=40)                       # growth in training
    assert moves and moves[0][1] in ("L1", "L2") and "trend" in moves[0][2], moves


def test_a_trend_is_projected_no_further_than_its_samples_reach_back():
    from leto_run.preinit import MemoryObservation, choose_level, headroom_at
    pol = PreinitPolicy(margin=GIB, horizon_s=30)
    young = MemoryObservation(total=80 * GIB, free=40 * GIB, active_peak=30 * GIB,
                              trend=2 * GIB, trend_span=1.0)
    old = MemoryObservation(total=80 * GIB, free=40 * GIB, active_peak=30 * GIB,
                            trend=2 * GIB, trend_span=60.0)
    assert headroom_at(young, DEFAULT_COSTS, Level.L3, Level.L3, 30) == 38 * GIB
    assert headroom_at(old, DEFAULT_COSTS, Level.L3, Level.L3, 30) == -20 * GIB
    assert choose_level(young, pol, DEFAULT_COSTS, Level.L3, Level.L3, 1e9).level == Level.L3
    d = choose_level(old, pol, DEFAULT_COSTS, Level.L3, Level.L3, 1e9)
    assert d.level == Level.L1 and "over 30 s" in d.reason, d


def test_the_warm_up_room_fits_the_active_s_return_to_its_peak():
    """What a shadow started now may take for its warm-up: with it held, the new shadow at its
    level and the actives back at their recent peaks, the device keeps the margin free -- at
    every point of actives whose memory swings between steps, on one device per rank and on a
    device two ranks share (both shadows replaced at once)."""
    for shared in (False, True):
        dev = Device()
        dev.held = {0: {}, 1: {}}
        ctl = ShadowLevels(PreinitPolicy(margin=GIB, horizon_s=10), nvml=dev)
        slots = _slots({0: "L3", 1: "L3"})
        if shared:
            for s in slots:
                s.device_uuid = "GPU-0"
        assert ctl.warmup_room(0.0, 0, Level.L3) is None       # nothing observed yet
        peak = 0
        for k in range(60):
            # a step's activations come and go (two actives share device 0: half as large)
            active = ((15 if shared else 30) + (8 if k % 4 == 0 else 0)) * GIB
            peak = max(peak, active)
            dev.held = {0: {}, 1: {}}
            for r in (0, 1):
                d = 0 if shared else r
                dev.held[d].update({100 + r: active, 200 + r: DEFAULT_COSTS.l3})
            now = k * 0.5
            ctl.decide(now, slots)
            for r in (0, 1):
                room, why = ctl.warmup_room(now, r, Level.L3)
                assert room > 0 and "free" in why
            # Every rank's shadow on device 0 is replaced: each new one takes L3 and then its
            # room for the warm-up, while every active there goes back to its peak.
            after = {pid: (peak if pid < 200 else DEFAULT_COSTS.l3 + room)
                     for pid in dev.held[0]}
            assert sum(after.values()) + GIB <= dev.total, (k, shared, room >> 20, why)
        # with room to spare the warm-up gets far more than the runtime's default of 1 GiB
        assert room > 8 * GIB, (shared, room >> 20)
        # a view older than the controller's window says nothing of now
        assert ctl.warmup_room(now + 31.0, 0, Level.L3) is None


def test_no_warm_up_room_without_a_driver():
    ctl = ShadowLevels(PreinitPolicy(), nvml=None)
    ctl.decide(0.0, _slots({0: "L3"}))
    assert ctl.warmup_room(0.0, 0, Level.L3) is None
