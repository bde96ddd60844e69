"""What one step's update does to each element range of the flat states: the parameter groups.

Role: the bridge between a torch optimizer's `param_groups` and RMU's chunk transactions.  The
layout puts each group's parameters in one contiguous element range (`Segment`), frozen
parameters after every group (in no segment: never updated).  For the step being updated,
`hypers[k]` holds group k's values (`chunk_math.Hyper`: lr, betas, weight decay, ...): the
optimizer sets them before the update of a step, or from the step's record before a recovery
finishes or redoes it, so a chunk updated twice (interrupted, restored from its undo copy,
redone) gets the same scalars.

`pieces(lo, hi)` cuts a chunk's element range [lo, hi) into the parts that lie in a segment,
each with its group's values; the math is elementwise and position independent
(chunk_math), so any cut gives the bits of the whole-tensor update.

The optimizer's states: `leto/exp_avg` and `leto/exp_avg_sq` are Adam's `exp_avg` and
`exp_avg_sq`; SGD keeps its momentum buffer in `leto/exp_avg` (the second state stays unused).

Calling contract: `Plan.of(layout, group_sizes, hypers, clip)`; `norm_slots` are the trainable
slots in `param_groups` order (the order `clip_grad_norm_` sees them in); set `hypers` (same
length, same kinds) before `Updater.step` / `Updater.resume`.
"""
from __future__ import annotations

from dataclasses import dataclass

from leto_runtime.rmu.chunk_math import Hyper


@dataclass(frozen=True)
class Segment:
    lo: int           # first element (flat fp32 index)
    hi: int           # one past the last element of the group's last parameter
    group: int        # index into param_groups


@dataclass
class Plan:
    segments: tuple[Segment, ...]
    norm_slots: tuple                # ParamSlot of every trainable parameter, group order
    clip: float | None
    hypers: list[Hyper]

    @classmethod
    def of(cls, layout, group_sizes: list[int], hypers: list[Hyper], clip: float | None) -> "Plan":
        """`group_sizes[k]`: how many layout slots (from the first) group k has, in order."""
        if len(group_sizes) != len(hypers):
            raise ValueError(f"{len(group_sizes)} groups but {len(hypers)} sets of values")
        segs, slots, i = [], [], 0
        for k, n in enumerate(group_sizes):
            mine = layout.params[i:i + n]
            i += n
            if mine:
                segs.append(Segment(mine[0].offset, mine[-1].offset + mine[-1].numel, k))
                slots.extend(mine)
        return cls(tuple(segs), tuple(slots), clip, list(hypers))

    def set_hypers(self, hypers: list[Hyper]) -> None:
        if len(hypers) != len(self.hypers) or any(
                a.kind != b.kind or a.n_states != b.n_states for a, b in zip(hypers, self.hypers)):
            raise ValueError("the optimizer's groups changed kind or state count during the "
                             "run: RMU keeps one state layout for the whole job")
        self.hypers = list(hypers)

    def pieces(self, lo: int, hi: int):
        """(a, b, Hyper): the parts of [lo, hi) inside a segment, as chunk-relative ranges."""
        for s in self.segments:
            a, b = max(lo, s.lo), min(hi, s.hi)
            if a < b:
                yield a - lo, b - lo, self.hypers[s.group]
