"""`job.optimizer(torch_opt, scheduler, clip_grad_norm)`: the script's own torch optimizer,
made an RMU transaction under leto-run and left to stock torch under plain torchrun.

The compatibility contract (docs/PORTING.md): `opt.step()` is
  gradients all-reduced (sum) and divided by the world size (one flat buffer) ->
  `torch.nn.utils.clip_grad_norm_(params in param_groups order, clip, foreach=False)` ->
  the optimizer's update -> `scheduler.step()`;
`zero_grad()` is done by `job.steps()` (the gradients are views the next backward fills).

* **Plain** (torchrun, `Job.inplace` false): exactly that, with the stock objects
  (`torch_opt.step()`, the scheduler), so a torchrun run is the independent reference of a
  leto-run one.  `LETO_PLAIN_RMU=1` (tests) runs the RMU path on local tensors instead.
* **In place** (leto-run): the update is RMU's chunk transaction over the retained states
  with each group's values (`rmu.plan.Plan`, `rmu.chunk_math`), bit-identical to the stock
  single-tensor update (`foreach=False`; on CPU also torch's default).  Before the gradients
  of step t are protected, the step's record -- every group's values and the scheduler's
  `state_dict()` -- goes to the job's store (`StepRecords`): a trainer that recovers loads the
  record of the step it finishes or redoes, so the update and the script's own
  `opt.param_groups[i]["lr"]` / `scheduler.get_last_lr()` are that step's.

Calling contract: made by `Job.optimizer` only; `step()` once per step of `job.steps()`;
`state_dict()` is torch's format for `torch_opt` (indices in `param_groups` order), with CPU
copies of the retained moments.
"""
from __future__ import annotations

import base64
import json
import pickle

import torch
import torch.distributed as dist

from leto_runtime import beats as hb
from leto_runtime import demotion
from leto_runtime import torch_optim as TO
from leto_runtime.rmu.guard import Guard
from leto_runtime.rmu.plan import Plan
from leto_runtime.rmu.updater import Updater
from leto_runtime.errors import PortingError


def check_scheduler(scheduler, torch_opt) -> str | None:
    if scheduler is None:
        return None
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler):
        return (f"{type(scheduler).__name__} is not supported: opt.step() calls "
                "scheduler.step() without arguments, so the scheduler must be a "
                "torch.optim.lr_scheduler.LRScheduler that needs no metric")
    if scheduler.optimizer is not torch_opt:
        return "the scheduler drives another optimizer than the one given to job.optimizer()"
    try:
        sd = scheduler.state_dict()
        back = pickle.loads(pickle.dumps(sd, protocol=4))
    except Exception as e:
        return (f"the scheduler's state_dict() cannot be pickled ({type(e).__name__}: {e}): "
                "its state is recorded each step for recovery; use lr_lambda functions or "
                "picklable objects")
    if back.keys() != sd.keys():
        return "the scheduler's state_dict() does not survive a pickle round trip"
    return None


class StepRecords:
    """Each step's values, in the job's store (it outlives the trainers): two slots, t % 2,
    per rank; a record names its step, so a stale slot is never taken for another step."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank

    def key(self, t: int) -> str:
        return f"leto/optim/r{self.rank}/{t % 2}"

    def write(self, t: int, hypers, scheduler) -> None:
        rec = {"t": t, "groups": [h.to_json() for h in hypers], "sched": _pack(scheduler)}
        self.store.set(self.key(t), json.dumps(rec))

    def read(self, t: int) -> dict | None:
        key = self.key(t)
        if not self.store.check([key]):
            return None
        rec = json.loads(self.store.get(key))
        if rec.get("t") != t:
            return None
        rec["sched"] = _unpack(rec["sched"])
        return rec


def _pack(scheduler) -> str | None:
    """The scheduler's state_dict(), pickled: a JSON round trip would turn MultiStepLR's
    milestone Counter keys into strings (and lr would never decay again).  The store is the
    job's authenticated one: only holders of the job key write it."""
    if scheduler is None:
        return None
    return base64.b64encode(pickle.dumps(scheduler.state_dict(), protocol=4)).decode()


def _unpack(text: str | None):
    return None if text is None else pickle.loads(base64.b64decode(text))


class AdoptedOptimizer:
    """What `job.optimizer` returns (see the module docstring)."""

    def __init__(self, job, torch_opt, scheduler, clip_grad_norm, rmu: bool):
        self.job, self.torch_opt, self.scheduler = job, torch_opt, scheduler
        self.clip = None if clip_grad_norm is None else float(clip_grad_norm)
        self.rmu = rmu
        self.hypers = TO.describe(torch_opt, job.device)
        # torch indexes every parameter of the groups (state_dict); a frozen one in a group is
        # skipped by torch's step (no grad) and laid out with the frozen ones here
        self.indexed = [p for ps in TO.ordered_params(torch_opt) for p in ps]
        self.groups = [[p for p in ps if p.requires_grad] for ps in TO.ordered_params(torch_opt)]
        self.trainable = [p for ps in self.groups for p in ps]
        self.frozen = [p for p in self.indexed if not p.requires_grad]
        self.plan: Plan | None = None
        self.records = StepRecords(job.store, job.rank) if job.inplace else None
        self.done = 0                                   # updates applied (Adam's `step`)
        if job.ss is not None:
            self._bind()

    # ---- binding (binding.materialize calls it after every mapping) ----------------------
    def _bind(self) -> None:
        j = self.job
        self.plan = Plan.of(j.layout, [len(ps) for ps in self.groups], self.hypers, self.clip)
        j.updater = Updater(j.ss, None, inject=j._inject, backend=j.parity,
                            transactions=j.transactions, plan=self.plan)
        j.guard = Guard(j.ss, j.updater, report=j._report, scrub_budget=j.ctx.scrub_budget)

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's own list (read each time: `load_state_dict` replaces it)."""
        return self.torch_opt.param_groups

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Done by `job.steps()` at the start of every step (the gradients stay views)."""

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> None:
        j = self.job
        t = j.step_t
        if t is None or j._stepped:
            raise PortingError("opt.step() is called once per step of job.steps()")
        if j.buffer_watch is not None:
            j.buffer_watch.check(t)
        if any(p.requires_grad for p in self.frozen) or not all(p.requires_grad
                                                                for p in self.trainable):
            raise PortingError("a parameter was frozen or unfrozen after job.optimizer(): the "
                             "retained layout keeps the frozen set of the start; freeze "
                             "before making the optimizer")
        j.check_grads(t, self.trainable)
        self.hypers = TO.describe(self.torch_opt, j.device)   # the scheduler's lr of step t
        try:
            self._sync_grads(t)
            if self.rmu:
                self._rmu_step(t)
            else:
                if self.clip is not None:
                    torch.nn.utils.clip_grad_norm_(self.trainable, self.clip, foreach=False)
                self.torch_opt.step()
        except Exception as e:
            demotion.on_error(e)      # a collective met the dead peer of a HOF
            raise
        self.done = t + 1
        self._scheduler_step()
        j._stepped = True

    def _sync_grads(self, t: int) -> None:
        j = self.job
        j.faults.fire("grads.allreduce", step=t)
        if j.grads_synced_by_ddp(t) or j.pg is None or j.world_size == 1:
            return
        G = j.ss.flat(j.ss.grads)[:j.layout.numel]
        hb.collective(t)
        dist.all_reduce(G)
        hb.left_collective(t)
        G.div_(j.world_size)

    def _rmu_step(self, t: int) -> None:
        j = self.job
        if j.checkpointer is not None:
            j.checkpointer.before_update(j, t)    # the shadow's snapshot of step t is done
        if self.records is not None:
            self.records.write(t, self.hypers, self.scheduler)
        self.plan.set_hypers(self.hypers)
        j.updater.step(t, j.pg if j.world_size > 1 else None)

    def _scheduler_step(self) -> None:
        if self.scheduler is not None:
            self.torch_opt._opt_called = True     # torch's check that the optimizer stepped first
            self.scheduler.step()

    # ---- recovery (resume.prepare) ----------------------------------------------------------
    def restore(self, res) -> None:
        """After the agreement (`rmu.recovery.Resume`), before anything is updated: the
        groups' values and the scheduler as they were at the step finished (`finish`: its
        record) or run next (its record if a rank wrote it, else the previous step's record
        and one scheduler step).  At the job's first step there is no record: the objects are
        as the script made them (fresh, or loaded from its checkpoint)."""
        if res.action == "start":
            return
        t = res.t if res.action == "finish" else res.step
        self.done = t
        start = self.job.start_step
        if self.records is None or t < start:
            return
        rec, advance = self.records.read(t), False
        if rec is None and res.action != "finish":
            if t == start:          # nothing recorded yet: the values the job started with
                if self.job.loaded is not None:
                    from leto_runtime import checkpoint
                    checkpoint.apply_values(self.job)
                return
            rec, advance = self.records.read(t - 1), True
        if rec is None:
            from leto_runtime.rmu.recovery import RecoveryError
            raise RecoveryError(f"no record of the optimizer's values of step {t} (nor of "
                                f"step {t - 1}) in the job's store: cannot resume step {t} "
                                "with the values it was computed with")
        from leto_runtime.rmu.chunk_math import Hyper
        TO.set_group_values(self.torch_opt, [Hyper.from_json(h) for h in rec["groups"]])
        if self.scheduler is not None and rec["sched"] is not None:
            self.scheduler.load_state_dict(rec["sched"])
        if advance:
            self._scheduler_step()
        self.hypers = TO.describe(self.torch_opt, self.job.device)
        if self.plan is not None:
            self.plan.set_hypers(self.hypers)

    def finished(self, t: int) -> None:
        """The update of step t was finished by recovery: the scheduler moves past it."""
        self.done = t + 1
        self._scheduler_step()

    # ---- torch's format --------------------------------------------------------------------
    def state_dict(self) -> dict:
        if not self.rmu:
            return self.torch_opt.state_dict()
        from leto_runtime.checkpoint import optimizer_state
        sd = self.torch_opt.state_dict()          # param_groups with indices; its state is empty
        j = self.job
        sd["state"] = optimizer_state(self, [j.ss.flat(st) for st in j.ss.model[1:]],
                                      self.done)
        return sd

    def slots(self):
        """(torch's index, layout slot, group values) of every trainable parameter."""
        index = {id(p): i for i, p in enumerate(self.indexed)}
        hyper = {id(p): h for ps, h in zip(self.groups, self.hypers) for p in ps}
        for p, slot in zip(self.trainable, self.plan.norm_slots):
            yield index[id(p)], slot, hyper[id(p)]
