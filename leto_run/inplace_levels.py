"""The in-place recovery's moves of the shadows between preinitialization levels
(docs/PREINIT.md): a mixin of `leto_run.inplace.InplaceRecovery`, kept apart for size.

Role: once a loop turn (`tick`) the controller's levels (`leto_run.preinit_control`) are applied
by relaunching every shadow of the next generation at its level (shadow epoch + 1); an injected
`preinit` pins a level and is confirmed to its active once the shadows are ready at it
(`contract.preinit_ack_key`); an active's `reclaim` datagram lowers the shadows at once when
that frees what it could not allocate.  Single node only: elsewhere the shadows keep their level.

Calling contract: the host class provides `g` (the worker group), `levels` (`ShadowLevels`),
`acks`, `epoch`, `unusable`, `policy`, `events`, `log`, `_client()`, `_kill_shadows()` and
`_spawn_shadow(slot, level)`; every method runs on the agent's loop thread.
"""
from __future__ import annotations

import json
import time

from leto_run.preinit import Level
from leto_run.slot import RankSlot, SlotProcess
from leto_runtime.wire import contract as C


OBSERVED_EVERY_S = 5.0     # how often the controller's view goes to the events file


class ShadowLevelMoves:
    _moving = False                 # a relaunch is under way (its kill pumps the selector)
    _observed_at = -OBSERVED_EVERY_S

    def _may_move(self) -> str | None:
        """Why the shadows must keep their level now (None: they may move): only where one
        agent restarts every shadow of the generation together (one node), never while a
        relaunch runs or a failure of the current generation waits for its recovery (a dead
        active's freed memory is no headroom, and its recovery needs the shadows as they are),
        and never once an active's training loop ended (its exit frees memory for no one)."""
        r, g = self.g.round, self.g
        if r is None or r.group_world_size > 1:
            return "with several nodes the shadows keep their level"
        if self._moving:
            return "the shadows are being relaunched"
        if self.unusable or not self.policy.inplace_enabled or not all(s.inplace for s in g.slots):
            return "no shadows to move"
        if self.remote is not None or any(f.generation == g.generation for f in g.failures):
            return "a failure of this generation waits for its recovery"
        if any(s.active is None or s.active.finished or s.active.done for s in g.slots):
            # its memory leaving the device is the job's end, not headroom
            return "the training loop has ended"
        return None

    def tick(self, now: float) -> None:
        """Once a loop turn: move the shadows to the controller's levels (docs/PREINIT.md)."""
        why = self._may_move()
        if why is None:
            d = self.levels.decide(now, self.g.slots)
            if d is not None:
                self._relevel(*d)
            self._confirm_levels()
        self._observed(now, why)

    def _observed(self, now: float, kept: str | None) -> None:
        """Every OBSERVED_EVERY_S: why the shadows are at their level (the last decision's
        figures and reasons, or why no move is considered now), so a kept level is explained."""
        if now - self._observed_at < OBSERVED_EVERY_S or self.g.round is None:
            return
        self._observed_at = now
        last = self.levels.last
        self.events.emit("preinit_observed", self.g.generation, kept=kept,
                         levels=last.get("levels"), seen=last.get("seen"),
                         why=last.get("why"), costs={"L2": self.levels.costs.l2,
                                                     "L3": self.levels.costs.l3})

    def _relevel(self, target: dict[int, Level], reason: str, warning: bool) -> None:
        gen = self.g.generation + 1
        was = {s.rank: s.shadow.level for s in self.g.slots if s.shadow is not None}
        self.log(("warning: " if warning else "") + f"shadows of generation {gen}: "
                 f"{', '.join(sorted(set(was.values())))} -> "
                 f"{', '.join(sorted({lv.name for lv in target.values()}))} ({reason})")
        self.events.emit("preinit", gen, levels={r: lv.name for r, lv in target.items()},
                         was=was, reason=reason, warning=warning, epoch=self.epoch + 1)
        self._moving = True
        try:
            self._kill_shadows()
            self.epoch += 1
            for s in self.g.slots:
                self._spawn_shadow(s, target.get(s.rank, self.levels.start_level(s.rank)))
        finally:
            self._moving = False

    def on_preinit_inject(self, slot: RankSlot, sp: SlotProcess, level: str, step: int) -> None:
        """An injected `preinit`: pin the level, confirm once the shadows are ready at it."""
        self.levels.pin(Level[level])
        self.acks.append((sp.generation, slot.rank, step))

    def on_reclaim(self, slot: RankSlot, sp: SlotProcess, detail: str | None) -> None:
        """The active of `slot` waits (bounded, in cuda/lend_alloc.cpp) for memory it could not
        allocate: lower the local shadows now if that frees enough (their kill frees it)."""
        try:
            request = int(detail or "")
        except ValueError:
            return
        why = self._may_move()
        levels, reason = ((None, why) if why is not None else
                          self.levels.reclaim(time.monotonic(), self.g.slots, slot.rank, request))
        self.events.emit("reclaim", sp.generation, rank=slot.rank, pid=sp.proc.pid,
                         bytes=request, reason=reason,
                         levels=None if levels is None else {r: v.name for r, v in levels.items()})
        if levels is None:
            self.log(f"rank {slot.rank} needs {request >> 20} MiB more: {reason}")
            return
        self._relevel(levels, f"reclaim for rank {slot.rank}: {reason}", False)

    def _confirm_levels(self) -> None:
        if not self.acks:
            return
        shadows = [(s.rank, s.shadow) for s in self.g.slots]
        if any(sp is None or not sp.ready or Level[sp.level] != self.levels.start_level(r)
               for r, sp in shadows):
            return
        for g, rank, step in self.acks:
            try:
                self._client().set(C.preinit_ack_key(g, rank, step),
                                   json.dumps({"levels": {r: sp.level for r, sp in shadows}}))
            except Exception as e:      # the active gives up waiting (bounded) and goes on
                self.log(f"cannot confirm the preinit change of rank {rank}: "
                         f"{type(e).__name__}: {e}")
        self.acks = []
