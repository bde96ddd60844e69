"""Where a trainer starts: the first trainer initializes the job's retained state, every later
one recovers it in place and resumes; and the step boundary before each step.

`prepare(job)` runs once, when `Job.steps()` starts (a promoted shadow: after it attached).  The
first trainer of a job zeroes the states, writes the initial parameters and encodes their parity
(`initialize`); every later one recovers through `rmu.recovery.prepare` -- localize and rebuild
lost pages, agree with the other ranks where to resume (`gather`: every rank's marker summary,
sealed with the job key under leto-run), repair, finish an interrupted update -- and each phase
is reported (`phase`: a heartbeat, `job.recovery_info`, a `phase` datagram).  It returns the
first step to run.

`boundary(job, t)` runs before step t touches retained memory: the page losses registered
meanwhile are repaired and a slice of the background scrub runs (`rmu.guard.Guard`).

Retained state that cannot be recovered in place (`RecoveryError`, `Unrecoverable`) ends the
process: `unrecoverable(e)` says why and exits with `contract.UNRECOVERABLE_EXIT`.

Calling contract: `job` is the process's `leto_runtime.job.Job`, its states and updater bound
(`Job.retain`, `Job.adamw`); `prepare` once, before the first `boundary`.  `Job` calls these
through the module (`resume.boundary(...)`), so a test may wrap them
(tests/integration/scripts/flip_bits.py wraps `boundary`).
"""
from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

from leto_runtime import beats as hb
from leto_runtime import demotion
from leto_runtime.wire import contract as C
from leto_runtime.rmu import recovery
from leto_runtime.rmu.marker import Phase
from leto_runtime.rmu.recovery import Progress, RecoveryError
from leto_runtime.rmp.reconstruct import Unrecoverable
from leto_runtime.trainer_log import log


def prepare(job) -> int:
    """Initialize (first trainer) or recover (every later one); returns the first step."""
    ss, up = job.ss, job.updater
    restore = getattr(job.opt, "restore", None)       # the adopted torch optimizer's values
    try:
        res, _ = recovery.prepare(ss, up, rank=job.rank,
                                  initialize=functools.partial(initialize, job),
                                  gather=functools.partial(gather, job), fire=job.faults.fire,
                                  phase=functools.partial(phase, job),
                                  transactions=job.transactions, restore=restore)
        if restore is not None and res.action == "finish":
            job.opt.finished(res.t)
        if not ss.created and job.loaded is not None:
            from leto_runtime import checkpoint
            checkpoint.ignored(job)
    except Exception as e:
        if isinstance(e, (RecoveryError, Unrecoverable)):
            unrecoverable(e)
        demotion.on_error(e)      # the agreement's collective met a dead peer
        raise
    if not ss.created or res.action != "start":
        phase(job, "resume", 0.0, step=res.step, action=res.action)
    return res.step


def initialize(job) -> None:
    """First trainer: zero every state, write the initial parameters, encode parity."""
    ss, up = job.ss, job.updater
    for st in (*ss.model, ss.grads):
        ss.flat(st).zero_()
    with torch.no_grad():
        if job.loaded is not None:
            from leto_runtime import checkpoint
            checkpoint.apply(job)
        elif job.init_fn is not None:
            job.init_fn(job.model, job.seed)
        else:
            torch.manual_seed(job.seed)
            for m in job.model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=job.start_step - 1, phase=Phase.DONE)
    if ss.client is not None:
        for st in ss.all:
            if st.marks:
                ss.client.clear_marks(st.name)


def gather(job, mine: Progress) -> list[Progress]:
    """Every rank's progress (one rank: `[mine]`), from an all-gather over the job's group."""
    if job.pg is None or job.world_size == 1:
        return [mine]
    from leto_runtime import promotion
    dev = job.device if job.backend == "nccl" else torch.device("cpu")
    words = mine.to_list()
    if job.inplace:            # the resume point is agreed among holders of the job key
        words = promotion.seal_progress(job.ctx, words)
    t = torch.tensor(words, dtype=torch.int64, device=dev)
    out = [torch.empty_like(t) for _ in range(job.world_size)]
    hb.collective(None)
    dist.all_gather(out, t)
    hb.left_collective(None)
    rows = [x.tolist() for x in out]
    if job.inplace:
        rows = promotion.open_progress(job.ctx, rows)
    return [Progress(*r) for r in rows]


def phase(job, name: str, seconds: float, **fields) -> None:
    """Recovery phase `name` took `seconds`: into `job.recovery_info` and the event log."""
    # A heartbeat per phase: recovery is progress, not a hang (a phase blocked for longer
    # than --hang-timeout, e.g. waiting on a dead peer, still is one).
    hb.heartbeat(None)
    job.recovery_info[name] = {"seconds": seconds, **fields}
    if job.inplace:
        from leto_runtime import promotion
        promotion.report_phase(name, seconds, **fields)


def boundary(job, t: int) -> None:
    """Honour page losses and scrub a slice before step t touches retained memory."""
    if job.guard is None:
        return
    try:
        job.guard.at_boundary(t)
    except Unrecoverable as e:
        unrecoverable(e)


def unrecoverable(e: Exception) -> None:
    """Say why (log and torchelastic error file, for the root-cause summary) and end with
    UNRECOVERABLE_EXIT; called inside the handler of `e`."""
    msg = (f"UNRECOVERABLE retained state: {e}. In-place recovery is impossible; the job "
           f"must restart from a checkpoint (exit code {C.UNRECOVERABLE_EXIT}).")
    log(msg)
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(e)
    except Exception as werr:       # no error file: the log line above still says why
        log(f"could not write the error file: {type(werr).__name__}: {werr}")
    sys.stdout.flush()
    sys.stderr.flush()
    from leto_runtime import exit_notice
    exit_notice.disarm()            # a deliberate exit: judged by its code, not at its start
    os._exit(C.UNRECOVERABLE_EXIT)
