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
measure C).  A checkpoint still being written when the next is due skips that one, unless the
next is the final one (the state training ends with): that one waits for the write.

Failures of the write (a full disk, a permission taken away, a path gone) never stop training:
the partial directory is removed, the failure is logged and reported (`phase` datagram
`checkpoint`, `error=`), and the next due boundary tries again.  A due checkpoint skipped (a
write in flight) is reported too (`checkpoint_skipped`, `reason=`).

Where rank 0 has a shadow (in-place mode, `writer` auto), the copy is the shadow's instead
(`leto_runtime.ckpt_snapshot`, over `ckpt_handshake`): the active only sends what retained
memory does not hold and waits, at the start of its update, for the shadow's claim that the
copy is complete -- normally long done by then.  A shadow that does not answer within
`snapshot_wait_s`, or declines, leaves the copy to the active, as without a shadow.

Calling contract: `Checkpointer.for_job(job)` is None when checkpointing is off or this rank
does not write; `maybe_save(job, t)` at the top of step t (after the boundary repair, before
the step writes retained memory: the state is that of t finished steps); `before_update(job,
t)` before step t's update writes the retained states; `finish(job, total, timeout)` when
training ends (the final checkpoint, then a bounded wait for a write in flight, here or in the
shadow).
"""
from __future__ import annotations

import math
import os
import secrets
import threading
import time
import warnings

from leto_runtime import ckpt_handshake as H
from leto_runtime.trainer_log import log
from leto_runtime.wire import ckpt_files as F
from leto_runtime.wire.ckpt_files import Settings

REPORT_CAP_S = 300.0        # a shadow's write report is given up on after this (or 10 writes)


def due(t: int, start: int, s: Settings, *, last_step: int | None, since_last: float,
        cost: float | None, min_interval: float = 0.0) -> tuple[bool, str]:
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
    if interval < min_interval:     # a stall-free checkpoint: bounded by the write, not C
        return since_last >= min_interval, (f"Young's interval {interval:.3g} s (C={cost:.3g} "
                                             f"s), at least twice the last write, {min_interval:.3g} s")
    return since_last >= interval, f"Young's interval {interval:.3g} s (C={cost:.3g} s)"


class Checkpointer:
    def __init__(self, settings: Settings, world_size: int, report, fault=None, peer=None):
        self.s, self.world_size, self.report = settings, world_size, report
        self.fault = fault or (lambda point, step: None)
        self.peer = peer                   # ShadowPeer: the shadow takes the snapshot
        self.last_step: int | None = None
        self.last_time = time.monotonic()
        self.cost: float | None = None
        self.write_s = 0.0                 # the last write's duration (auto's floor)
        self.thread: threading.Thread | None = None
        self.pending: tuple[int, str, dict] | None = None  # (step, why, small part) asked
        self.unsettled: str | None = None  # a claim this trainer could not read: it stops

    @classmethod
    def for_job(cls, job) -> "Checkpointer | None":
        """None when checkpointing is off or this rank does not write."""
        s, ctx = job.ctx.checkpoint, job.ctx
        if s is None or job.rank != 0:
            return None
        peer = (ShadowPeer.of(ctx, s.snapshot_wait_s if s.writer == "shadow" else 0.0)
                if job.inplace and s.writer in ("auto", "shadow") else None)
        return cls(s, ctx.world_size, job._report_phase, job.faults.fire_in_thread, peer)

    def maybe_save(self, job, t: int, final: bool = False, wait_s: float = 0.0) -> bool:
        """Checkpoint the state of t finished steps if one is due.  A write still in flight
        skips it -- except the `final` one (the state training ends with), which waits up to
        `wait_s` for that write rather than be lost.  True when a due one was skipped."""
        self._refuse_unsettled()
        yes, why = due(t, job.start_step, self.s, last_step=self.last_step,
                       since_last=time.monotonic() - self.last_time, cost=self.cost,
                       min_interval=2.0 * self.write_s)
        if not yes or F.check(os.path.join(self.s.directory, F.name(t))).complete:
            return False              # (complete already: a promoted trainer redoes step t)
        if self._writing() and not (final and self._idle_within(wait_s)):
            why_not = ("the previous one is still being written"
                       + (f" after {wait_s:g} s" if final else ""))
            log(f"checkpoint of step {t} skipped: {why_not}")
            self.report("checkpoint_skipped", 0.0, step=t, reason=why_not)
            return True
        self.last_step, self.last_time = t, time.monotonic()
        # The last one is taken here: the shadow may be stopped as soon as training ends.
        small = None if final or self.peer is None else self.peer.ask(job, t, why)
        if small is not None:
            self.pending = (t, why, small)
            return False
        self._take(job, t, why)
        return False

    def before_update(self, job, t: int) -> None:
        """At the start of step t's update, before anything writes the retained states: the
        shadow's snapshot of step t must be complete now, or the trainer takes it itself."""
        self._refuse_unsettled()
        if self.pending is None:
            return
        step, why, small = self.pending
        if step != t:
            self.pending = None
            return
        try:
            verdict, waited = self.peer.settle(self.s.snapshot_wait_s)
        except H.ClaimUnsettled as e:
            self.unsettled = (f"checkpoint of step {t}: {e}; the trainer stops before its "
                              "update, so a copy the shadow may have claimed cannot be torn")
            log(self.unsettled)
            raise H.ClaimUnsettled(self.unsettled) from None
        self.pending = None
        if verdict == H.SHADOW_OK:
            self.cost = waited
            self.report("checkpoint_snapshot", waited, step=t, by="shadow")
            return
        log(f"checkpoint of step {t}: the shadow did not take it ({verdict}); taking it here")
        self._take(job, t, why, small)

    def _refuse_unsettled(self) -> None:
        """Once a claim went unread, every later step refuses too (a script that caught the
        exception must not update under a copy that may count)."""
        if self.unsettled is not None:
            raise H.ClaimUnsettled(self.unsettled)

    def _take(self, job, t: int, why: str, small: dict | None = None) -> None:
        """Copy the state of step t to host memory (the step waits for this part only) and
        write it from a thread.  `small`: the part taken at the top of step t (buffers, the
        groups' values, the scheduler -- the forward may have changed them since), beside the
        retained states, which nothing has written since."""
        from leto_runtime import checkpoint
        t0 = time.monotonic()
        state = job.state_dict() if small is None else checkpoint.retained_copy(job, small)
        stall = time.monotonic() - t0
        self.cost = stall
        self.thread = threading.Thread(target=self._own_write, args=(state, t, stall, why),
                                       name=f"leto-checkpoint-{t}", daemon=True)
        self.thread.start()

    def _own_write(self, state: dict, t: int, stall: float, why: str) -> None:
        info = write(state, t, self.s, self.world_size, self.report, self.fault, stall=stall,
                     why=why, extra={"by": "trainer"})
        self.write_s = info.get("write_s", 0.0)
        if self.peer is not None:
            self.peer.longest = max(self.peer.longest, self.write_s)

    def _writing(self) -> bool:
        if self.thread is not None and self.thread.is_alive():
            return True
        if self.peer is None:
            return False
        info = self.peer.writing()
        if info is True:
            return True
        if isinstance(info, dict) and "write_s" in info:
            self.write_s = float(info["write_s"])
            self.peer.longest = max(self.peer.longest, self.write_s)
        return False

    def _idle_within(self, timeout: float) -> bool:
        """Wait (bounded) until no write is in flight, here or in the shadow."""
        end = time.monotonic() + timeout
        if self.thread is not None:
            self.thread.join(timeout)
        while self._writing() and time.monotonic() < end:
            time.sleep(0.05)
        return not self._writing()

    def finish(self, job, t: int, timeout: float) -> None:
        """When training ends: the final checkpoint (t steps), if due, then a wait (bounded)
        for the write in flight, here or in the shadow.  A write the final one already waited
        `timeout` for in vain is not waited for again."""
        if self.maybe_save(job, t, final=True, wait_s=timeout) or not self._idle_within(timeout):
            log(f"the checkpoint being written did not finish within {timeout:g} s; "
                "its partial directory is never loaded")


class ShadowPeer:
    """The trainer's side of the handshake with the shadow of its rank (`ckpt_handshake`)."""

    def __init__(self, hs: H.Handshake, wait_s: float = 0.0):
        self.wait_s = wait_s                       # writer "shadow": wait for one to serve
        self.hs = hs
        self.next: dict[int, int] = {}            # epoch -> next request number
        self.waited = False                       # writer "shadow" waited in vain already
        self.dead: set[int] = set()               # epochs that did not answer in time
        self.asked: tuple[int, int, int] | None = None   # (epoch, n, pid) of the request
        self.unsent = False                       # ... which may not have reached the store
        self.last: tuple[int, int, int, float] | None = None  # (e, n, pid, since): unreported
        self.longest = 0.0                        # the longest write seen (the report's cap)

    @classmethod
    def of(cls, ctx, wait_s: float = 0.0) -> "ShadowPeer":
        """The peer of this rank's shadow (the next generation's), over the job's store."""
        from leto_runtime import promotion
        return cls(H.Handshake(lambda: promotion.worker_store(ctx, timeout=H.CALL_S),
                               ctx.generation + 1, ctx.rank), wait_s)

    def ask(self, job, t: int, why: str) -> dict | None:
        """Send the request for the state of step t: the small part sent, or None when no
        shadow serves or the request could not be sent (the trainer copies the state)."""
        from leto_runtime import checkpoint
        srv = self._server()
        if srv is None:
            return None
        e = int(srv["epoch"])
        n = self.next.get(e, 0)
        if job.device.type == "cuda":
            import torch
            torch.cuda.synchronize(job.device)    # the shadow reads what the GPU has written
        small = checkpoint.small_part(job)
        self.next[e] = n + 1                      # (a request half sent is never reused)
        self.asked, self.unsent = (e, n, int(srv.get("pid", 0))), False
        try:
            self.hs.request(e, n, {**small, "why": why})
        except H.NotSent as err:                  # it never reached the store: n is free
            self.next[e], self.asked = n, None
            log(f"checkpoint request of step {t} not sent ({err}); the trainer copies the state")
            return None
        except Exception as err:
            # It may have arrived all the same: the shadow could be copying now.  The trainer
            # claims it before its update (`settle`), as for a shadow that did not answer.
            log(f"checkpoint request of step {t} may not have been sent ({type(err).__name__}:"
                f" {err}); the trainer claims it at its update and copies the state")
            self.unsent = True
        return small

    def _server(self) -> dict | None:
        """The serving shadow (a new epoch's after one that failed), waiting up to `wait_s`
        for one to start serving (writer "shadow": a shadow starting up or being replaced) --
        once: while none serves, later due steps do not wait again."""
        end = time.monotonic() + (0.0 if self.waited else self.wait_s)
        while True:
            srv = self.hs.server()
            if srv is not None and int(srv.get("epoch", -1)) not in self.dead:
                self.waited = False
                return srv
            if time.monotonic() >= end:
                self.waited = self.wait_s > 0
                if self.waited:
                    log(f"no shadow serves checkpoint snapshots after {self.wait_s:g} s; the "
                        "trainer copies the state until one does")
                return None
            time.sleep(0.05)

    def settle(self, timeout: float) -> tuple[str, float]:
        """Wait (bounded; cut short when the shadow's process is gone, or the request may not
        have been sent) for the verdict; raises `H.ClaimUnsettled` when it cannot be read."""
        e, n, pid = self.asked
        t0, end = time.monotonic(), time.monotonic() + (0.0 if self.unsent else timeout)
        verdict = None
        while verdict is None:
            left = end - time.monotonic()
            if left > 0.5 and _alive(pid):      # wait in slices; claim only at the end
                verdict = self.hs.verdict(e, n, 0.5, settle=False)
            else:
                verdict = self.hs.verdict(e, n, 0.0)
        if verdict == H.TRAINER and self.unsent:
            self._void(e, n)
        elif verdict == H.TRAINER:
            self.dead.add(e)
        elif verdict == H.SHADOW_OK:
            self.last = (e, n, pid, time.monotonic())
        return verdict, time.monotonic() - t0

    def _void(self, e: int, n: int) -> None:
        """Request n was claimed by the trainer and may never have arrived: void it, so the
        shadow's numbers stay in step with ours -- or, failing that, stop asking this epoch."""
        try:
            self.hs.void(e, n, "claimed by the trainer; the request may not have arrived")
        except Exception as err:
            log(f"checkpoint request {n} could not be voided ({type(err).__name__}: {err}); "
                "no more snapshots from this shadow")
            self.dead.add(e)

    def writing(self):
        """True while the shadow writes the last snapshot it took; else its report (or None).
        A shadow alive that has not reported after `report_cap()` s is given up on (its report
        was lost): no more snapshots from its epoch, the trainer copies the state."""
        if self.last is None:
            return None
        e, n, pid, since = self.last
        info = self.hs.written(e, n)
        if info is None and _alive(pid):
            cap = self.report_cap()
            if time.monotonic() - since < cap:
                return True
            self.dead.add(e)
            info = {"ok": False, "error": f"the shadow (pid {pid}) did not report its write of "
                    f"request {n} within {cap:g} s; no more snapshots from it"}
            log(f"checkpoint: {info['error']}")
        self.last = None       # reported, or the shadow died writing (its partial is torn)
        return info or {"ok": False, "error": f"the shadow (pid {pid}) ended before its write"}

    def report_cap(self) -> float:
        return max(REPORT_CAP_S, 10.0 * self.longest)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def write(state: dict, t: int, s: Settings, world_size: int, report, fault, *,
          stall: float | None, why: str, extra: dict) -> dict:
    """Store `state` as the checkpoint of step t (the module docstring's layout); never raises
    (for `write_errors()`, DCP's CheckpointException included): a failure is logged and
    reported, its partial directory removed.  Returns {"ok", "path" | "error", "write_s"}.
    Two writers of one step (a promoted shadow's write in flight, its redone step's) each fill
    a partial directory of their own; the first rename wins and the other counts as written."""
    d = s.directory
    tmp = os.path.join(d, F.partial_name(t, os.getpid(), F.pid_space() + secrets.token_hex(4)))
    final = os.path.join(d, F.name(t))
    t0 = time.monotonic()
    try:
        os.makedirs(d, exist_ok=True)
        _save(state, tmp)
        fault("checkpoint.write", t)
        man = F.manifest(t, world_size, tmp)
        _write_synced(os.path.join(tmp, F.MANIFEST), man)
        F.fsync_dir(tmp)
        F.rename_noreplace(tmp, final)      # never over an entry someone else put there
        F.fsync_dir(d)
    except write_errors() as e:             # never fatal: training goes on
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)        # this write's own directory only
        if F.check(final).complete:
            log(f"checkpoint of step {t}: {final} was written by another writer meanwhile")
            return {"ok": True, "path": final, "write_s": time.monotonic() - t0}
        cause = describe_error(e) + _space_note(d, state)
        log(f"warning: checkpoint of step {t} into {d} failed ({cause}); its partial directory "
            "is removed, training goes on, the next due step tries again")
        _report_safely(report, t, cause, d, extra)
        return {"ok": False, "error": cause, "write_s": time.monotonic() - t0}
    removed = F.rotate(d, s.keep)
    nbytes = sum(man["files"].values())
    took = time.monotonic() - t0
    stalled = "" if stall is None else f"stall {stall * 1e3:.1f} ms, "
    log(f"checkpoint of step {t}: {final} ({nbytes} bytes; {stalled}write {took:.2f} s; "
        f"by the {extra.get('by', 'trainer')}; {why})")
    report("checkpoint", stall or 0.0, step=t, path=final, bytes=nbytes, write_s=took,
           removed=[f.path for f in removed], **extra)
    return {"ok": True, "path": final, "write_s": took}


def write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: any Exception, and DCP's CheckpointException, which derives
    from BaseException (every I/O error of `dcp.save` arrives wrapped in one).  Not BaseException
    itself: KeyboardInterrupt and SystemExit must still end the process."""
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)


def describe_error(e: BaseException) -> str:
    """One line naming the cause: a CheckpointException's str is every rank's traceback, so
    its wrapped exceptions are named instead (e.g. "OSError: [Errno 28] No space left ...")."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = {f"{type(exc).__name__}: {exc}" for exc, _ in failures.values()}
        return f"{type(e).__name__} ({'; '.join(sorted(causes))})"
    return f"{type(e).__name__}: {e}"


def _space_note(d: str, state: dict) -> str:
    """Why, when the disk is full: DCP often reports that only as a torn zip ("unexpected
    pos"), so the free space is named beside the state's size."""
    need = 0

    def walk(obj):
        nonlocal need
        if hasattr(obj, "untyped_storage") and hasattr(obj, "element_size"):
            need += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
    walk(state)
    try:
        st = os.statvfs(d if os.path.isdir(d) else os.path.dirname(os.path.abspath(d)))
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return ""
    return (f"; the file system has {free} bytes free, the state needs about {need}: free "
            "space there or point --checkpoint-dir elsewhere")


def _report_safely(report, t: int, cause: str, d: str, extra: dict) -> None:
    """The failure's report; a report that fails itself (the store gone) is logged only."""
    try:
        report("checkpoint", 0.0, step=t, error=cause, dir=d, **extra)
    except Exception as e:
        log(f"checkpoint of step {t}: its failure could not be reported ({type(e).__name__}: "
            f"{e})")


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
    from torch.distributed.checkpoint.api import CheckpointException
    template = job.state_dict()
    try:
        dcp.load(template, checkpoint_id=path, no_dist=True)
    except CheckpointException as e:   # a BaseException: the rank's error reporting misses it
        raise RuntimeError(f"checkpoint {path} could not be read ({describe_error(e)}); check "
                           "the file system holding it, or remove it to fall back to an older "
                           "one") from e
    job.load_state_dict(template)
