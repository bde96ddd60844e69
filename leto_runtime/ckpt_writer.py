"""Periodic checkpoints of the job's state, written beside training (`--checkpoint-dir`).

Role: at a step boundary that `due` selects, rank 0's active trainer copies `job.state_dict()`
(model, optimizer in torch's format, scheduler, step: `leto_runtime.checkpoint`) to host memory
-- the only part the training step waits for -- and a writer thread stores it with
`torch.distributed.checkpoint` (no collectives: `no_dist=True`) as the layout of
`leto_runtime.wire.ckpt_files` says: a hidden partial directory, every file fsynced, the
manifest last, an atomic rename, then the older checkpoints rotated out (`--checkpoint-keep`).
Data parallelism keeps every rank's state bit-identical, so rank 0's copy is the job's state;
stock `dcp.load` reads it into a job of any world size.

When: `every_steps` (at steps that are multiples of it, so the steps stay the same across a
fallback), `every_s` (the first boundary `every_s` after the last checkpoint), or Young's
interval sqrt(2 * C * MTBF) for the non-HOF failure rate `ff_mtbf` (paper §8.1), C being the
step's stall of the last checkpoint (the first checkpoint is taken after the first step, to
measure C).  A checkpoint still being written when the next is due skips that one.

Failures of the write (a full disk, a permission taken away, a path gone) never stop training:
the partial directory is removed, the failure is logged and reported (`phase` datagram
`checkpoint`, `error=`), and the next due boundary tries again.

Calling contract: `Checkpointer.from_context(ctx, rank)` is None when checkpointing is off or
this rank does not write; `maybe_save(job, t)` at the top of step t (after the boundary repair,
before the step writes retained memory: the state is that of t finished steps); `close(timeout)`
when training ends (waits for a write in flight, bounded).
"""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
from leto_runtime.trainer_log import log
from leto_runtime.wire import ckpt_files as F
from leto_runtime.wire.ckpt_files import Settings


def due(t: int, start: int, s: Settings, *, last_step: int | None, since_last: float,
        cost: float | None) -> tuple[bool, str]:
    """Should the state of `t` finished steps be checkpointed now? -> (yes, why)."""
    if t <= start or t == last_step:
        return False, "nothing new since the start or the last checkpoint"
    if s.every_steps:
        return (t % s.every_steps == 0), f"every {s.every_steps} steps"
    if s.every_s:
        return since_last >= s.every_s, f"every {s.every_s:g} s"
    if cost is None:
        return True, "the first checkpoint measures the cost of one (Young's interval)"
    interval = math.sqrt(2.0 * max(cost, 1e-6) * s.ff_mtbf)
    return since_last >= interval, f"Young's interval {interval:.3g} s (C={cost:.3g} s)"


class Checkpointer:
    def __init__(self, settings: Settings, world_size: int, report, fault=None):
        self.s, self.world_size, self.report = settings, world_size, report
        self.fault = fault or (lambda point, step: None)
        self.last_step: int | None = None
        self.last_time = time.monotonic()
        self.cost: float | None = None
        self.thread: threading.Thread | None = None

    @classmethod
    def from_context(cls, ctx, rank: int, report, fault=None) -> "Checkpointer | None":
        s = ctx.checkpoint
        if s is None or rank != 0:
            return None
        return cls(s, ctx.world_size, report, fault)

    def maybe_save(self, job, t: int) -> None:
        yes, why = due(t, job.start_step, self.s, last_step=self.last_step,
                       since_last=time.monotonic() - self.last_time, cost=self.cost)
        if not yes or F.check(os.path.join(self.s.directory, F.name(t))).complete:
            return                    # (complete already: a promoted trainer redoes step t)
        if self.thread is not None and self.thread.is_alive():
            log(f"checkpoint of step {t} skipped: the previous one is still being written")
            return
        t0 = time.monotonic()
        state = job.state_dict()           # host copies: the step waits for this part only
        stall = time.monotonic() - t0
        self.cost, self.last_step, self.last_time = stall, t, time.monotonic()
        self.thread = threading.Thread(target=self._write, args=(state, t, stall, why),
                                       name=f"leto-checkpoint-{t}", daemon=True)
        self.thread.start()

    def _write(self, state: dict, t: int, stall: float, why: str) -> None:
        d = self.s.directory
        tmp = os.path.join(d, F.partial_name(t, os.getpid()))
        t0 = time.monotonic()
        try:
            os.makedirs(d, exist_ok=True)
            _save(state, tmp)
            self.fault("checkpoint.write", t)
            man = F.manifest(t, self.world_size, tmp)
            _write_synced(os.path.join(tmp, F.MANIFEST), man)
            F.fsync_dir(tmp)
            final = os.path.join(d, F.name(t))
            os.rename(tmp, final)
            F.fsync_dir(d)
        except Exception as e:                  # never fatal: training goes on
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"warning: checkpoint of step {t} into {d} failed ({type(e).__name__}: {e}); "
                "training goes on, the next due step tries again")
            self.report("checkpoint", 0.0, step=t, error=f"{type(e).__name__}: {e}", dir=d)
            return
        removed = F.rotate(d, self.s.keep)
        nbytes = sum(man["files"].values())
        log(f"checkpoint of step {t}: {final} ({nbytes} bytes; stall {stall * 1e3:.1f} ms, "
            f"write {time.monotonic() - t0:.2f} s; {why})")
        self.report("checkpoint", stall, step=t, path=final, bytes=nbytes,
                    write_s=time.monotonic() - t0, removed=[f.path for f in removed])

    def close(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                log(f"the checkpoint being written did not finish within {timeout:g} s; "
                    "its partial directory is never loaded")


# One process writes the whole (replicated) state on purpose: DCP's note says it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


def _save(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    os.makedirs(path)
    dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True), no_dist=True)


def _write_synced(path: str, obj: dict) -> None:
    import json
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def check_job(job) -> None:
    """Checkpoints need the state in torch's format (`job.state_dict()`): refused at the start,
    not at the first checkpoint."""
    if job.ctx.checkpoint is not None and not hasattr(job.opt, "torch_opt"):
        from leto_runtime.errors import PortingError
        raise PortingError("--checkpoint-dir needs job.optimizer(torch_opt, ...): the state of "
                           "job.adamw() has no torch.optim format to checkpoint yet; build "
                           "torch.optim.AdamW over the groups and pass it to job.optimizer "
                           "(docs/PORTING.md), or drop --checkpoint-dir")


def fallback_load(job) -> None:
    """The agent's fallback (LETO_CHECKPOINT_LOAD): start `job` from that checkpoint."""
    t0, path = time.monotonic(), job.ctx.checkpoint_load
    load_into(job, path)
    log(f"fallback: starting from checkpoint {path}")
    job._report_phase("checkpoint_load", time.monotonic() - t0, path=path,
                      step=int(job.loaded["step"]))


def load_into(job, path: str) -> None:
    """Fill `job` from the complete checkpoint at `path` (the agent's fallback): every rank
    reads it on its own (`no_dist=True`), then `job.load_state_dict`."""
    import torch.distributed.checkpoint as dcp
    found = F.check(path)
    if not found.complete:      # the agent checked it; a change since is refused, not loaded
        raise RuntimeError(f"checkpoint {path} is not complete: {found.reason}")
    template = job.state_dict()
    dcp.load(template, checkpoint_id=path, no_dist=True)
    job.load_state_dict(template)
