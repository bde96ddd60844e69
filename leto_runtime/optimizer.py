"""`opt.step()` of the runtime API: the RMU-backed AdamW that `Job.adamw(model, config)` returns.

`step()` is one step's update: the gradients' all-reduce across the data-parallel ranks, then
`rmu.updater.Updater.step` (gradient protection, global synchronization, the chunk
transactions).  The optimizer binds the job's updater and step-boundary guard
(`rmu.guard.Guard`) to the job's retained states: when it is made, if the states exist, and
again each time the job maps them afresh (`Job._materialize` calls `_bind`).

Calling contract: made by `Job.adamw` only (`job` is the process's `leto_runtime.job.Job`);
`step()` exactly once per step of `job.steps()`; `zero_grad()` does nothing (`job.steps()`
zeroes the gradients, which stay views of retained memory).
"""
from __future__ import annotations

import torch.distributed as dist

from leto_runtime import beats as hb
from leto_runtime import demotion, modules
from leto_runtime.rmu import adamw as A
from leto_runtime.rmu.guard import Guard
from leto_runtime.rmu.updater import Updater
from leto_runtime.errors import PortingError


class Optimizer:
    """`opt.step()`: gradient all-reduce, protection, global synchronization, RMU update."""

    def __init__(self, job, cfg: "A.AdamWConfig"):
        self.job, self.config = job, cfg
        if job.ss is not None:
            self._bind()

    def _bind(self) -> None:
        j = self.job
        j.updater = Updater(j.ss, self.config, inject=j._inject, backend=j.parity,
                            transactions=j.transactions)
        j.guard = Guard(j.ss, j.updater, report=j._report, scrub_budget=j.ctx.scrub_budget)

    @property
    def lr(self) -> float:
        return A.lr_at(self.config, self.job.step_t or 0)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Gradients are zeroed by `job.steps()` at the start of every step (kept as views)."""

    def step(self) -> None:
        j = self.job
        t = j.step_t
        if t is None or j._stepped:
            raise PortingError("opt.step() is called once per step of job.steps()")
        modules.refuse_frozen(j.model)      # frozen after retain(): decay would still move them
        if j.buffer_watch is not None:
            j.buffer_watch.check(t)
        j.check_grad_views(t, [p for p in j.model.parameters()])
        G = j.ss.flat(j.ss.grads)[:j.layout.numel]
        j.faults.fire("grads.allreduce", step=t)
        try:
            if not j.grads_synced_by_ddp(t) and j.pg is not None and j.world_size > 1:
                hb.collective(t)
                dist.all_reduce(G)
                hb.left_collective(t)
                G.div_(j.world_size)
            j.updater.step(t, j.pg if j.world_size > 1 else None)
        except Exception as e:
            demotion.on_error(e)      # a collective met the dead peer of a HOF
            raise
        j._stepped = True
