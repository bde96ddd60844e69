"""The runtime API a training script uses for in-place recovery (README: "Runtime API").

    import leto_runtime as leto

    job = leto.init()                              # env contract; shadows preinitialize here
    with job.meta_init():                          # no second copy of the model state
        model = GPT(cfg)
    model = job.retain(model, init=init_weights)   # parameters become views of retained memory
    opt = job.adamw(model, leto.AdamWConfig.paper(total_steps=1000))
    for step in job.steps(1000):                   # shadows block here until promoted
        with job.autocast():
            _, loss = model(*batch(seed, step, job.rank))   # data: a function of (seed, step, rank)
        loss.backward()                            # gradients land in retained, protected buffers
        opt.step()                                 # all-reduce, protect, sync, RMU transaction

Roles (from the env contract, `leto_runtime.context`):
* **active** under `leto-run` with a state manager: model state, optimizer moments, gradients and
  RMU's buffers live in the rank slot's Resilient Memory Pool.  The first active of a job
  initializes them (`init(model, seed)` writes the parameters in place, deterministically);
  every later trainer -- a promoted shadow, or a restarted one -- attaches to what is retained,
  localizes and rebuilds lost pages, agrees with the other ranks where to resume (finish the
  interrupted update, or redo the iteration) and continues.
* **shadow**: `init()` preinitializes to its level (LETO_PREINIT_LEVEL, docs/PREINIT.md) and
  tells the agent.  At L3 (imports, device context, process group of its generation)
  `steps()` blocks until the agent promotes it (rank 0's takes the checkpoints meanwhile:
  `ckpt_snapshot`); at L1 (imports only) or L2 (+ device context) `init()` itself blocks, so
  the script's set-up (model, optimizer, DDP) runs after the promotion, once the missing
  levels are up.  Then it recovers as above.
* **plain** (`torchrun`, or no state manager): the same code on ordinary tensors.  Nothing
  survives the process, but the arithmetic is identical, so a plain run is the fault-free
  reference of an in-place run.

What the script must keep: data and randomness are functions of (seed, step, rank) --
`steps()` seeds torch's RNG per step; buffers are constant (computed in `__init__`, or by
`retain(..., buffers=fn)`; leto_runtime.modules).  A model wrapped in DDP after
`job.optimizer()` (`init_sync=False`) has its gradients averaged by DDP; otherwise `opt.step()`
all-reduces them (docs/PORTING.md).

The pieces around the job: `resume` (initialize or recover the retained state before the first
step, and the step boundary before each), `optimizer` (`opt.step()`), `trainer_log` (log lines).

Calling contract: one `Job` per process (`init()` returns the same one when called again);
`retain` before `adamw` before `steps`; `opt.step()` exactly once per step.  A retained state
that cannot be recovered in place ends the process with `contract.UNRECOVERABLE_EXIT` after a
clear message; the agent falls back to a checkpoint (docs/CHECKPOINTS.md) or ends the job.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import time

import torch
import torch.distributed as dist

from leto_runtime import beats as hb
from leto_runtime.wire import contract as C
from leto_runtime import binding, demotion, errors, exit_notice, levels, modules, resume, runtime
from leto_runtime.context import Context
from leto_runtime.faults import Faults
from leto_runtime.optimizer import Optimizer
from leto_runtime.rmu import adamw as A
from leto_runtime.rmu.guard import Guard
from leto_runtime.trainer_log import log
from leto_runtime.errors import PortingError


def init(*, backend: str | None = None, seed: int = 0, device: str | None = None,
         transactions: bool = True) -> "Job":
    """Join the job (see the module docstring).  `transactions=False` is the RMU ablation
    (paper Fig. 12): for experiments only, it gives up exactness after a failure."""
    rt = runtime.current()
    if rt.job is None:
        rt.job = Job(Context.from_env(), backend=backend, seed=seed, device=device,
                     transactions=transactions)
    return rt.job


def _pick_device(ctx: Context, device: str | None) -> torch.device:
    """`device` as given, except that a bare "cuda" means this local rank's GPU, as the default
    does (streams, events and the VMM need an index)."""
    dev = torch.device(device) if device else None
    if dev is None and torch.cuda.is_available():
        dev = torch.device("cuda")
    if dev is None:
        return torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", ctx.local_rank % max(1, torch.cuda.device_count()))
    return dev


class Job:
    def __init__(self, ctx: Context, *, backend, seed, device, transactions):
        t0 = time.monotonic()
        errors.install(ctx.error_file)    # before anything can fail: the agent classifies by it
        self.ctx, self.seed, self.transactions = ctx, seed, transactions
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.inplace = bool(ctx.under_leto and ctx.sm_socket and ctx.recovery == "inplace")
        self.role = ctx.role if self.inplace else "plain"
        self.device = _pick_device(ctx, device)
        self.parity = "auto" if self.inplace else "none"    # what retains nothing protects nothing
        # A shadow preinitializes to its level (LETO_PREINIT_LEVEL; leto_runtime.levels).
        self.level = ctx.preinit_level if self.role == "shadow" else "L3"
        self._woke_early: float | None = None     # promoted inside init() (a shadow below L3)
        self.states_absent = False     # a shadow's pre-attach found no states yet (binding)
        levels.device_up(self) if self.level != "L1" else None
        per_gpu = torch.cuda.device_count() >= ctx.local_world_size if self.device.type == "cuda" else False
        self.backend = backend or ("nccl" if per_gpu else "gloo")
        self.faults = Faults(ctx)
        self.store = None
        self.model = None
        self.opt = None
        self.ss = None
        self.updater = None
        self.guard: Guard | None = None           # step-boundary loss repair and scrub
        self._hooks: list = []                    # fault-point hooks on the model
        self.buffer_watch: modules.BufferWatch | None = None
        self.param_order = None                   # the optimizer's groups (layout order)
        self.bound = False                        # parameters are views of the states
        self.loaded: dict | None = None           # load_state_dict's checkpoint
        self.start_step = 0                       # the first step of this job (steps(start=))
        self.checkpointer = None                  # rank 0's periodic checkpoints (ckpt_writer)
        self._grads_seen: set[int] = set()        # parameters that got a gradient this step
        self._grad_views: dict[int, int] = {}     # id(param) -> data_ptr of its gradient view
        self._ddp_sync: bool | None = None        # DDP's sync of this step (None: no DDP)
        self.init_fn = self.buffers_fn = None
        self.warmup_fn = None                     # a shadow's warm-up forward (warmup.py)
        self._warming = False
        self.layout = None
        self.step_t: int | None = None
        self._stepped = True
        self.recovery_info: dict = {}
        if self.level == "L3":
            self._init_pg()
        else:
            levels.wait_below_l3(self, t0)
        if self.inplace and ctx.demote == "release":
            demotion.install(ctx)
            if self.role == "active":
                demotion.arm(self)
        self._t0 = t0
        if self.inplace and self.level == "L3":
            from leto_runtime import promotion      # a shadow: ready once it waits, in steps()
            promotion.install_wake() if self.role == "shadow" else promotion.announce_active(self.device)
        hb.heartbeat(None) if self.role != "shadow" else None

    # ---- process group -------------------------------------------------------------------
    def _init_pg(self) -> None:
        ctx = self.ctx
        timeout = datetime.timedelta(seconds=ctx.pg_timeout)
        kw = levels.group_options(self.backend, self.device, ctx.world_size, self.inplace)
        if dist.is_initialized():
            self._adopt_pg()
        elif self.inplace:
            from leto_runtime import promotion
            if self.store is None:
                self.store = promotion.worker_store(ctx)
            prefix = dist.PrefixStore(C.pg_prefix(ctx.generation, ctx.shadow_epoch), self.store)
            dist.init_process_group(self.backend, store=prefix, rank=ctx.rank,
                                    world_size=ctx.world_size, timeout=timeout, **kw)
        elif ctx.world_size > 1 or ctx.master_addr:
            dist.init_process_group(self.backend, timeout=timeout, **kw)
        if dist.is_initialized():
            # A group still alive when the interpreter exits can abort the process in the
            # backend's C++ teardown: it is destroyed at exit if the script did not.
            import atexit
            atexit.unregister(_destroy_group)     # once, whatever the generations
            atexit.register(_destroy_group)
        self.pg = dist.group.WORLD if dist.is_initialized() else None
        exit_notice.check_fence()          # the communicators' device files above the fence too

    def _adopt_pg(self) -> None:
        """The script made the default process group itself: kept under torchrun (if it is
        this job's ranks); refused in place, where the group must be the generation's own."""
        ctx = self.ctx
        if self.inplace:
            raise PortingError(
                "the script created the default process group before leto_runtime.init(): "
                "in place, the group is made by init() (one per generation, over the job's "
                "authenticated store). Call leto.init() first and create a group only "
                "`if not dist.is_initialized()`")
        if (dist.get_rank(), dist.get_world_size()) != (ctx.rank, ctx.world_size):
            raise PortingError(
                f"the script's process group has rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {ctx.rank} of "
                f"{ctx.world_size}: make it over the env:// defaults, or let init() make it")

    # ---- model construction ----------------------------------------------------------------
    def meta_init(self):
        """Build the model with its parameters on the meta device: shapes only, no values, no
        memory (`retain(init=...)` writes them once, in retained memory).  Buffers computed in
        `__init__` keep their values; `torch.nn.init` does nothing meanwhile (leto_runtime.modules)."""
        return modules.meta_params()

    def autocast(self):
        """bf16 compute with fp32 master state on GPUs; a no-op on CPU.  (No weight-cast cache
        during a shadow's warm-up: it would hold a bf16 copy of every weight at once.)"""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not self._warming)
        return contextlib.nullcontext()

    def warmup(self, fn) -> None:
        """Register `fn()`, one forward pass of the model (the script's contexts included) that
        returns the forward's output (its loss): a waiting shadow runs it before its promotion,
        on placeholder parameters, under no_grad and then once with gradients for the
        backward's warm-up, so the promoted trainer's first step runs at steady speed
        (leto_runtime/warmup.py; a no-op for actives and under torchrun)."""
        if not callable(fn):
            raise PortingError(f"job.warmup(fn): fn must be callable, got {type(fn).__name__}")
        self.warmup_fn = fn

    def retain(self, model: torch.nn.Module, init=None, buffers=None) -> torch.nn.Module:
        """Make `model`'s parameters views of retained memory (a shadow: at promotion).
        `init(model, seed)` writes initial values in place (first trainer only; default: each
        submodule's reset_parameters under torch.manual_seed(seed))."""
        left = modules.meta_buffers(model)
        if left and buffers is None:
            raise PortingError(f"buffers {', '.join(left[:4])} are on the meta device: pass "
                             "retain(model, buffers=fn) where fn(model) fills them, or build "
                             "them in __init__ under job.meta_init() (buffers keep their values)")
        modules.refuse_mutating(model)
        modules.refuse_dtypes(model)
        modules.placeholders(model, self.device)
        self.model, self.init_fn, self.buffers_fn = model, init, buffers
        self.layout = None
        return model

    def _open_states(self, param_order) -> None:
        """The optimizer is known: lay the states out by its groups and open them (a shadow:
        map them now if they exist, else at promotion)."""
        if self.model is None:
            raise PortingError("call job.retain(model) before making the optimizer")
        if self.opt is not None:
            raise PortingError("the job has an optimizer already: make one per job")
        self.param_order = param_order
        if self.role != "shadow":
            binding.materialize(self)
        elif self.inplace and self._woke_early is None:
            binding.preattach(self)         # (promoted already: attach_at_promotion attaches)

    def _inject(self, point: str, **where) -> None:
        """The updater's points: injection, and around the global synchronization (a
        collective among several ranks) the beats that tell the agent who waits for whom."""
        if point == "sync" and self.world_size > 1:
            hb.collective(where.get("step"))
        elif point == "sync.after" and self.world_size > 1:
            hb.left_collective(where.get("step"))
        self.faults.fire(point, **where)

    def adamw(self, model: torch.nn.Module, config: "A.AdamWConfig | None" = None, **kw) -> "Optimizer":
        """The RMU-backed AdamW over `model`'s retained parameters (`config` or its fields)."""
        if model is not self.model:
            raise PortingError("adamw(model): pass the model returned by job.retain()")
        modules.refuse_frozen(model)
        if config is not None and not isinstance(config, A.AdamWConfig):
            raise TypeError(f"adamw(model, config): config must be a leto_runtime.rmu.adamw."
                            f"AdamWConfig, got {type(config).__name__} (parameter groups are "
                            "not supported by adamw(); its fields go as keywords: lr=..., ...)")
        cfg = config or A.AdamWConfig(**kw)
        self._open_states(None)
        self.opt = Optimizer(self, cfg)
        return self.opt

    def optimizer(self, torch_opt, scheduler=None, clip_grad_norm: float | None = None):
        """The script's own `torch.optim.AdamW` / `Adam` / `SGD` (any parameter groups) and
        LR scheduler, made transactional (leto_runtime.adopted; the contract: docs/PORTING.md).
        `clip_grad_norm`: `clip_grad_norm_` over the optimizer's parameters before each update."""
        from leto_runtime import adopted
        from leto_runtime import torch_optim as TO
        from leto_runtime.wire import settings
        if self.model is None:
            raise PortingError("call job.retain(model) before job.optimizer(...)")
        msg = adopted.check_scheduler(scheduler, torch_opt)
        if msg is not None:
            raise TO.UnsupportedOptimizer(msg)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise PortingError(f"clip_grad_norm={clip_grad_norm!r} must be a number > 0, or None")
        TO.describe(torch_opt, self.device)             # refusals before anything is opened
        self._open_states(TO.ordered_params(torch_opt))
        rmu = self.inplace or settings.get().plain_rmu
        self.opt = adopted.AdoptedOptimizer(self, torch_opt, scheduler, clip_grad_norm, rmu)
        return self.opt

    def note_forward(self, ddp) -> None:
        """Forward ran (`ddp`: the DDP wrapping the retained model, or None)."""
        if ddp is None:
            return
        why = modules.ddp_problem(ddp, self.inplace, self.world_size)
        if why is not None:
            raise PortingError(why)
        self._ddp_sync = bool(ddp.require_backward_grad_sync)
        if self.updater is not None:
            # DDP's rebuilt buckets live as long as DDP: they must not land in lent memory.
            self.updater.hold_lending("DDP has not rebuilt its gradient buckets yet"
                                      if modules.ddp_rebuild_pending(ddp) else None)

    def grads_synced_by_ddp(self, t: int) -> bool:
        """DDP all-reduced step t's gradients (its last forward was not under `no_sync()`)."""
        if self._ddp_sync is False:
            raise PortingError(f"step {t}: the model's last forward ran under DDP's no_sync(), "
                               "so its gradients were never averaged across ranks: run the "
                               "last micro-batch of a step outside no_sync()")
        return self._ddp_sync is True

    def check_grad_views(self, t: int, params) -> None:
        """Every parameter's gradient is still its view of retained memory."""
        moved = [p for p in params if p.grad is None
                 or p.grad.data_ptr() != self._grad_views.get(id(p))]
        if moved:
            names = {id(p): n for n, p in self.model.named_parameters()}
            raise PortingError(
                f"the gradient of {names.get(id(moved[0]), '?')} is no longer its view of "
                f"retained memory in step {t}: model.zero_grad() or the torch optimizer's "
                "zero_grad() replaced it (job.steps() zeroes the gradients; call nothing, or "
                "the zero_grad() of the object job.optimizer() returned)")

    def check_grads(self, t: int, params) -> None:
        """Every trainable parameter got a gradient in step t: torch skips one that did not,
        and Leto would update it (one step count for all)."""
        self.check_grad_views(t, params)
        missing = [p for p in params if id(p) not in self._grads_seen]
        if missing:
            names = {id(p): n for n, p in self.model.named_parameters()}
            listed = ", ".join(names.get(id(p), "?") for p in missing[:4])
            raise PortingError(f"parameters {listed}{' ...' if len(missing) > 4 else ''} got no "
                             f"gradient in step {t}: every trainable parameter must take part "
                             "in every step (freeze the unused ones: requires_grad_(False))")

    # ---- the step loop ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The runtime state as CPU copies (model, optimizer in torch's format, scheduler, next
        step): what `torch.distributed.checkpoint` or `torch.save` store (leto_runtime.checkpoint)."""
        from leto_runtime import checkpoint
        return checkpoint.state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Start from `sd` (a `state_dict()`, e.g. filled by `dcp.load`) instead of `init`; a
        trainer that recovers in place ignores it (the retained state is newer)."""
        from leto_runtime import checkpoint
        checkpoint.load(self, sd)

    def steps(self, total: int, start: int | None = None):
        """Yield the iterations to run, from `start` (default: the loaded checkpoint's step,
        else 0); blocks a shadow until it is promoted, and starts where recovery says (see
        the module docstring)."""
        if self.opt is None:
            raise PortingError("call job.optimizer(...) or job.adamw(model, ...) before job.steps()")
        from leto_runtime import ckpt_writer
        ckpt_writer.check_job(self)
        if self.role != "shadow" and self.ctx.checkpoint_load:    # the agent's fallback
            ckpt_writer.fallback_load(self)
            start = None              # the script's own start was for its own checkpoint
        saved = int(self.loaded["step"]) if self.loaded is not None else 0
        if start is None:
            start = saved
        if start != saved:
            raise PortingError(f"steps(total, start={start}): the optimizer's state is that of "
                             f"step {saved} ({'the loaded checkpoint' if self.loaded else 'none loaded'}"
                             "), and its step count (Adam's bias correction, SGD's first "
                             f"momentum step) follows the step: start at {saved}")
        self.start_step = start
        if self.role == "shadow":
            from leto_runtime import promotion
            if self._woke_early is not None:      # below L3: promoted in init() already
                self.recovery_info["woke"] = self._woke_early
            else:
                self.recovery_info["woke"] = levels.wait_at_l3(self)
            self.role = "active"
            demotion.arm(self)
            hb.heartbeat(None)
            fields = binding.attach_at_promotion(self)
            promotion.report_phase("attach", self.recovery_info["attach_s"], **fields)
        binding.bind_views(self)
        start = resume.prepare(self)
        ckpt = self.checkpointer = ckpt_writer.Checkpointer.for_job(self)
        for t in range(start, total):
            if not self._stepped:
                raise PortingError(f"opt.step() was not called in step {self.step_t}")
            self.step_t, self._stepped = t, False
            self._grads_seen.clear()
            self._ddp_sync = None
            hb.heartbeat(t)
            self.faults.fire("step", step=t)
            resume.boundary(self, t)
            if ckpt is not None:
                ckpt.maybe_save(self, t)
            self.updater.begin(t)
            # -0.0, not 0.0: x + -0.0 is x for every x, so the first gradient accumulated into
            # the view keeps its bits, as torch's first backward does when it creates `.grad`.
            self.ss.flat(self.ss.grads).fill_(-0.0)
            torch.manual_seed(self.step_seed(t))
            yield t
        if not self._stepped:
            raise PortingError(f"opt.step() was not called in step {self.step_t}")
        if self.guard is not None and self.guard.scrubber is not None:
            st = self.guard.scrubber.stats
            self._report("scrub", action="summary", slices=st.slices, bytes=st.bytes,
                         seconds=st.seconds, passes=st.passes, repaired=st.repaired,
                         boundary_repairs=self.guard.repairs.count)
        demotion.finished()
        # The loop has ended: what follows (the final checkpoint, which may wait for a write in
        # flight) is no hang; the agent names a rank slow to exit with its stacks instead.
        hb.done()
        if ckpt is not None:
            ckpt.finish(self, total, self.ctx.pg_timeout)

    def step_seed(self, t: int) -> int:
        return (self.seed * 1_000_003 + t) * 65_537 + self.rank

    def _report(self, kind: str, **fields) -> None:
        """A boundary repair or a scrub finding: the event log (a `phase` datagram) and, where
        something was found, one line in this rank's log."""
        if kind != "scrub" or fields.get("action") not in ("ok", "summary"):
            log(f"{kind}: {fields}")
        if self.inplace:
            from leto_runtime import promotion
            promotion.report_phase(kind, float(fields.pop("seconds", 0.0)), **fields)

    def _report_phase(self, kind: str, seconds: float, **fields) -> None:
        if self.ctx.under_leto:
            from leto_runtime import promotion
            promotion.report_phase(kind, seconds, **fields)

    # ---- demotion (leto_runtime.demotion) -------------------------------------------------
    def release(self) -> dict:
        """Give up this process's hold on the job after a demotion: the parameters' views, the
        retained mappings, the device memory (synchronized first: no queued kernel may write
        retained memory afterwards).  Returns figures for the `demoted` datagram.  Fast on
        purpose (the promotion waits for it): no full garbage collection, which costs
        hundreds of ms with torch loaded; `release_group()` and the collection follow."""
        if self.updater is not None:
            self.updater.close()      # lending ends: no pool segment is left in RMU's buffers
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.model is not None:
            for p in self.model.parameters():       # the views go even if the module lives on
                p.grad = None
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # Every holder of the states' views goes: the guard and its scrubber hold them too.
        self.opt = self.updater = self.model = self.guard = None
        ss, self.ss = self.ss, None
        out = demotion.release_memory(self.device)
        if ss is not None and ss.client is not None:
            try:
                ss.client.close(unmap=True, timeout=1.0)
            except Exception as e:    # views the script still holds: that mapping stays
                out["views_alive"] = f"{type(e).__name__}: {e}"
        return out

    def release_group(self) -> None:
        """The process group of a generation that is over (already aborted by the demotion's
        wake thread) is destroyed, so that `init()` can form the next one."""
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:        # an aborted group may refuse a clean destroy
            log(f"destroying the old process group: {type(e).__name__}: {e}")
        self.pg = self.store = None

    # ---- results -------------------------------------------------------------------------
    def state_digest(self) -> str:
        """sha256 of the used part of params, exp_avg and exp_avg_sq (exactness checks)."""
        h = hashlib.sha256()
        n = self.layout.numel
        for st in self.ss.model:
            h.update(self.ss.flat(st)[:n].detach().cpu().numpy().tobytes())
        return h.hexdigest()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        n = self.layout.numel
        return {st.name: self.ss.flat(st)[:n].detach().cpu().clone() for st in self.ss.model}


def _destroy_group() -> None:
    """At exit, while the interpreter is whole: destroy the default group *and* drop the job's
    reference to it, so the backend (gloo's, NCCL's threads) is torn down now.  A group the job
    still referenced outlived destroy_process_group() and died in interpreter finalization,
    which aborts the process at random ("terminate called without an active exception")."""
    from leto_runtime import runtime
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:           # already torn down, or aborted: nothing left to release
        pass
    job = runtime.current().job
    if job is not None:
        job.pg = None
    import gc
    gc.collect()
