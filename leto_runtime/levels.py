"""A shadow's preinitialization levels, inside the trainer (docs/PREINIT.md; the agent's
controller that picks them: `leto_run.preinit`, `leto_run.preinit_control`).

| level | the process has                                               | GPU memory        |
|-------|---------------------------------------------------------------|-------------------|
| L1    | started, Python and torch imported, the script's code so far  | none              |
| L2    | + the device context and Leto's native kernels loaded          | context + modules |
| L3    | + the process group of its generation (NCCL communicators)     | + communicators   |

A shadow at L3 waits in `job.steps()`, with its model, optimizer and pre-attached retained
state (`leto_runtime.job`).  Below L3 it waits inside `leto_runtime.init()`, before the process
group: the group is formed by the shadows of one generation together, and a script builds DDP
over it right after `init()`, so nothing after `init()` can run without it.  Once promoted, it
brings up the levels it lacks -- on the recovery's critical path, which is the price of the
memory it did not hold -- and the script's set-up (model on meta, optimizer, DDP) runs as an
active's would.  The phase datagram `bringup` says the level it started from and the seconds of
each level it brought up (`l2_s`, `l3_s`); the report shows them.

Calling contract: `device_up(job)` once per process (the job's device, inplace and ctx are
set); `wait_below_l3(job, t0)` from `Job.__init__` for a shadow whose level is below L3,
after the job's fields exist; it returns promoted, with the process group formed and
`job._woke_early` set to the wake time.  `wait_at_l3(job)` from `job.steps()` for a shadow at
L3: what it prepares while it waits (a late pre-attach, the rehearsed update, the lending
pool), then its wake time.
"""
from __future__ import annotations

import time

import torch

from leto_runtime import beats as hb
from leto_runtime.trainer_log import log


def device_up(job) -> None:
    """Level L2: the device context, and the native kernels this job uses loaded (built first,
    on a machine's first run: minutes, before any heartbeat arms hang detection or any peer
    waits on this rank in the process group; leto_runtime/kernels.py)."""
    from leto_runtime import kernels
    if job.device.type == "cuda":
        torch.cuda.set_device(job.device)
        torch.zeros(1, device=job.device)      # the CUDA context now, not at the first kernel
        # A setting only the first opt.step() would read is checked here, before the process
        # group: a typo is a start-up error, not a crash of every promoted shadow.
        from leto_runtime.rmu import fused
        fused.layout()
    # Retained states are protected by parity; a run that retains nothing (plain torchrun)
    # protects nothing (parity backend "none": no native kernel is built or loaded on CPU, and
    # on CUDA its update kernels load on first use).
    if job.inplace or (job.ctx.under_leto and job.device.type == "cuda"):
        kernels.prepare(job.device, retained=job.inplace)
    from leto_runtime import exit_notice
    exit_notice.check_fence()          # the context's device files must sit above the fence


def group_options(backend: str, device, world_size: int, inplace: bool) -> dict:
    """init_process_group's keyword arguments.  NCCL: the communicator eagerly, on the job's
    device (L3 is the communicator made).  In place at world size 1 it has one channel: a
    one-rank communicator moves no data (its collectives are a copy or nothing), but NCCL gives
    it 64 channels of ~6 MiB each, which a waiting shadow would hold beside its active for
    nothing (docs/PREINIT.md, "A smaller L3")."""
    if backend != "nccl":
        return {}
    kw = {"device_id": device}
    if inplace and world_size == 1:
        import torch.distributed as dist
        try:
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.max_ctas = 1
        except AttributeError:          # a torch without NCCL's config: its default channels
            return kw
        kw["pg_options"] = opts
    return kw


def wait_below_l3(job, t0: float) -> None:
    """A shadow at L1 or L2: ready now, promoted here, then up through the missing levels.  A
    process that already holds a CUDA context (a survivor demoted in process) is at L2, whatever
    L1 asked for."""
    from leto_runtime import promotion
    ctx = job.ctx
    if job.level == "L1" and job.device.type == "cuda" and torch.cuda.is_initialized():
        job.level = "L2"
    job.store = promotion.worker_store(ctx)
    promotion.install_wake()
    promotion.announce_inplace({"level": job.level, "seconds": time.monotonic() - t0})
    job._woke_early = promotion.wait_for_promotion(ctx, job.store)
    hb.heartbeat(None)              # an active now: its hang detection runs from here
    times = {}
    if job.level == "L1":
        t = time.monotonic()
        device_up(job)
        times["l2_s"] = time.monotonic() - t
    t = time.monotonic()
    job._init_pg()
    times["l3_s"] = time.monotonic() - t
    hb.heartbeat(None)
    promotion.report_phase("bringup", sum(times.values()), level=job.level, **times)


def wait_at_l3(job) -> float:
    """A shadow at L3, from `job.steps()`: ready (the script's set-up done, the retained state
    pre-attached), it waits for its promotion and returns the wake time.  While it waits:
    the update rehearsed on scratch and the lending pool made (`ready_for_first_step`).  One
    that was ready before its active made the states pre-attaches them once they exist, then
    waits on (`binding.states_watch`)."""
    from leto_runtime import binding, ckpt_snapshot, promotion
    ready_for_first_step(job)
    promotion.announce_inplace({"level": "L3", "seconds": time.monotonic() - job._t0})
    while True:
        watch = binding.states_watch(job)
        with ckpt_snapshot.serving(job):      # rank 0's: checkpoints while it waits
            woke = promotion.wait_for_promotion(job.ctx, job.store, until=watch)
        if woke is not None:
            return woke
        t0 = time.monotonic()
        binding.preattach(job)
        if job.ss is None:          # failed (logged): attach at promotion, as before
            job.states_absent = False
            continue
        job.recovery_info["preattach_late_s"] = time.monotonic() - job._t0
        log(f"pre-attached the retained states once the active had made them "
            f"({time.monotonic() - t0:.2f} s)")
        ready_for_first_step(job)


def ready_for_first_step(job) -> None:
    """A pre-attached shadow pays now what the promoted trainer's first step would: one
    update on scratch memory (`rmu.rehearsal`: the update's kernels loaded, its code paths
    warm), the activation-lending pool (its library, regions and cuBLAS workspaces) and the
    script's warm-up forward, if it registered one (`warmup`, once).  A failure of any is
    logged; the first step then pays it, as without this.
    `LETO_REHEARSE=0` skips the rehearsal."""
    if job.updater is None:
        return
    from leto_runtime.rmu import rehearsal
    from leto_runtime.wire import settings
    try:
        if settings.get().rehearse:
            job.recovery_info["rehearsal_s"] = rehearsal.rehearse(job.updater)
    except Exception as e:
        log(f"update not rehearsed before promotion ({type(e).__name__}: {e})")
    t0 = time.monotonic()
    try:
        job.updater.prepare_lending()
    except Exception as e:
        log(f"lending pool not prepared before promotion ({type(e).__name__}: {e}); "
            "creating it at the first step")
        return
    job.recovery_info["lend_prepare_s"] = time.monotonic() - t0
    from leto_runtime import warmup
    s = warmup.run(job)
    if s is not None:
        job.recovery_info["warmup_s"] = s
        job.recovery_info["warmup_backward"] = getattr(job, "warmup_backward", None)
        cap = getattr(job, "warmup_cap", None)
        if cap is not None:
            job.recovery_info["warmup_cap_mib"] = cap[0] >> 20
            job.recovery_info["warmup_cap_from"] = cap[1]
