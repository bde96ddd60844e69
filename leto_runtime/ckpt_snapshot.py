"""The no-stall checkpoint: rank 0's shadow snapshots retained memory while the active computes.

Role: the shadow side of `leto_runtime.ckpt_handshake`.  A waiting shadow of rank 0 has the
retained states mapped (`binding.preattach`) and, on a GPU, a CUDA context of its own; while
it waits for promotion, a thread of it serves the active's checkpoint requests:

1. the active, at the top of a due step t (after its boundary repair; its GPU work finished),
   sends what retained memory does not hold (group values, scheduler, buffers: small) and
   goes on computing step t -- the compute phase never writes the retained model states;
2. the shadow brings its mappings up to date (`refresh`: pages repaired since), refuses if a
   loss is pending, copies the retained params and optimizer states -- into device memory of
   its own when the device has room for it beside the active (`staging_place`), else straight
   to pinned host memory -- checks again that no loss was registered meanwhile, and claims
   "ok"; the active waits for that claim at the start of its update (`before_update`), where
   RMU would first write the states;
3. after the claim the shadow moves the copy to host memory, frees its device staging, and
   writes the checkpoint exactly as the trainer-side writer does (`ckpt_writer.write`), from a
   thread of the lowest CPU priority.

A shadow that cannot take a request (no pre-attached states, a remapped state, a pending
loss, a copy that fails) answers "skip" and the active copies the state itself, as without a
shadow; an active that waited `snapshot_wait_s` in vain claims the request and does the same,
and the shadow's late copy is discarded.  Exactness never depends on the shadow: its copy
counts only when it was complete before the active's update began.

Calling contract: `serving(job)` is a context manager around the shadow's wait for promotion;
leaving it (promotion, or the store gone) stops serving: a copy in flight is cut short (a
device-staged one finishes: it is short) before promotion maps and writes the states; a write
in flight goes on in its thread, and the page-locked host copies are unregistered after it.
A page that loses its memory while the copy reads it may kill the shadow (SIGBUS on a host
tier), as it would at promotion: the active then sees the shadow gone and copies the state.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

from leto_runtime import ckpt_handshake as H
from leto_runtime.trainer_log import log

SLICE_S = 30.0              # a request wait's slice (a timed-out wait gets a fresh client)
DEVICE_MARGIN = 2 << 30     # device memory left free beside a staging copy, at least ...
DEVICE_MARGIN_SHARE = 0.05  # ... or this share of the device
CUT_BYTES = 256 << 20       # a host-staged copy checks for a promotion this often


def staging_place(free: int, need: int, total: int) -> tuple[str, str]:
    """Where the shadow copies the state first: "device" (fast: the active waits for a
    device-to-device copy only) when `need` bytes fit with a margin, else "host" (the active
    may wait for part of a device-to-host copy, but the active's memory is never squeezed)."""
    margin = max(DEVICE_MARGIN, int(DEVICE_MARGIN_SHARE * total))
    if free - need >= margin:
        return "device", f"{need / 2**30:.2f} GiB of {free / 2**30:.2f} GiB free"
    return "host", (f"{need / 2**30:.2f} GiB would leave less than {margin / 2**30:.2f} GiB of "
                    f"{free / 2**30:.2f} GiB free on the device")


@contextlib.contextmanager
def serving(job):
    server = SnapshotServer.start(job)
    try:
        yield server
    finally:
        if server is not None:
            server.stop()


class SnapshotServer:
    def __init__(self, job):
        from leto_runtime import promotion
        self.job, ctx = job, job.ctx
        self.epoch, self.settings = ctx.shadow_epoch, ctx.checkpoint
        self.hs = H.Handshake(lambda: promotion.worker_store(ctx, timeout=H.CALL_S),
                              ctx.generation, ctx.rank)
        self.lock = threading.Lock()           # held while the copy reads the mappings
        self.stopping = threading.Event()
        self.stale: str | None = None          # the mappings no longer show retained memory
        self.host: dict = {}                   # page-locked host copies, by state-dict path
        self.host_lock = threading.Lock()      # the host copies' owner: a write, or release
        self.write_busy = False
        self.stream = None
        self.thread = threading.Thread(target=self._loop, name="leto-snapshot", daemon=True)

    @classmethod
    def start(cls, job) -> "SnapshotServer | None":
        ctx = job.ctx
        if (ctx.checkpoint is None or ctx.rank != 0 or job.role != "shadow" or job.ss is None
                or not hasattr(job.opt, "torch_opt") or job.opt.plan is None):
            return None
        try:
            server = cls(job)
            server.hs.serve(server.epoch, os.getpid())
        except Exception as e:
            log(f"checkpoint snapshots not served by this shadow ({type(e).__name__}: {e}); "
                "the active takes them itself")
            return None
        server.thread.start()
        return server

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving: a copy in flight is cut short at its next slice; a write in flight
        goes on (the page-locked host copies are given back when it ends)."""
        self.stopping.set()
        if not self.lock.acquire(timeout=timeout):
            raise RuntimeError(f"the checkpoint snapshot still reads retained memory after "
                               f"{timeout:g} s: this shadow cannot take over")
        self.lock.release()
        with self.host_lock:
            if not self.write_busy:
                self._release_host()

    # ---- the serving thread ------------------------------------------------------------------
    def _loop(self) -> None:
        if self.job.device.type == "cuda":
            torch.cuda.set_device(self.job.device)
            self.stream = torch.cuda.Stream(device=self.job.device)
        n = 0
        while not self.stopping.is_set():
            try:
                req = self.hs.next_request(self.epoch, n, SLICE_S)
            except H.BadRequest as e:      # a forged or unreadable request: never served
                log(f"checkpoint {e}: refused")
                self._answer(n, f"{H.SHADOW_SKIP} {e}")
                n += 1
                continue
            except Exception as e:          # the store is not answering: the same request again
                log(f"checkpoint requests: the store did not answer ({type(e).__name__}: {e})")
                self.stopping.wait(1.0)
                continue
            if req is None:
                continue
            if "void" in req:               # claimed by the trainer, never to be served
                n += 1
                continue
            try:
                self._serve(n, req)
            except Exception as e:
                log(f"checkpoint snapshot of step {req.get('step')} failed ({type(e).__name__}: "
                    f"{e}); the active takes it")
                self._answer(n, f"{H.SHADOW_SKIP} {type(e).__name__}: {e}")
            n += 1

    def _answer(self, n: int, verdict: str) -> bool | None:
        """Claim request n; True when the claim stands, False when the trainer's does, None
        when the store did not tell (`ClaimUnsettled`)."""
        try:
            return self.hs.answer(self.epoch, n, verdict)
        except H.ClaimUnsettled as e:
            log(f"checkpoint request {n}: {e}")
            return None
        except Exception:
            return False                    # the active settles the claim itself

    def _serve(self, n: int, req: dict) -> None:
        t, box, place = int(req["step"]), [], "cpu"
        try:
            why, place, copy_s = self._copy_locked(req, box)
            if why is None:
                self.job.faults.fire_in_thread("checkpoint.snapshot", t)  # copied, not claimed
            if why is not None:
                self._answer(n, f"{H.SHADOW_SKIP} {why}")
                log(f"checkpoint snapshot of step {t} not taken: {why}")
                return
            stood = self._answer(n, H.SHADOW_OK)
            if stood is None:       # the trainer may have read "ok": it waits for a report
                self._report(n, {"ok": False, "error": "the shadow could not read its claim"})
            if not stood:
                log(f"checkpoint snapshot of step {t} discarded: the active stopped waiting "
                    "for it, or the claim could not be read")
                return
            try:
                self._write(n, t, req, box, place, copy_s)
            except Exception as e:  # after a claim that stands: the active waits for a report
                self._report(n, {"ok": False, "error": f"{type(e).__name__}: {e}"})
                raise
        finally:
            self._drop(box, place)  # (the write's thread took the copy, if it started)

    def _copy_locked(self, req: dict, box: list) -> tuple[str | None, str, float]:
        """Under `lock` (a promotion waits for it before it maps the states): the copy into
        `box`, or why not.  Returns (why not | None, where it went, seconds)."""
        with self.lock:
            if self.stopping.is_set():
                return "the shadow is taking over", "cpu", 0.0
            why = self._fresh_mappings()
            if why is not None:
                return why, "cpu", 0.0
            t0 = time.monotonic()
            place = self._copy(req, box)
            copy_s = time.monotonic() - t0
            return self._pending_loss("during the copy"), place, copy_s

    def _drop(self, box: list, place: str) -> None:
        if not box:
            return
        box.clear()
        if place == "device":
            torch.cuda.empty_cache()        # the staging goes back to the device at once

    def _fresh_mappings(self) -> str | None:
        """Bring the mappings up to date; a reason not to copy, or None.  A state re-created
        under its name leaves this shadow's views stale for good: every later request too is
        refused (promotion maps afresh)."""
        if self.stale is None:
            rep = self.job.ss.client.refresh()
            if rep.views_invalid:
                self.job.recovery_info["stale_views"] = True
                self.stale = f"retained states re-created ({', '.join(rep.views_invalid)})"
            elif rep.dropped:
                return f"pages without memory ({sum(rep.dropped.values())})"
        if self.stale is not None:
            return self.stale
        return self._pending_loss("before the copy")

    def _pending_loss(self, when: str) -> str | None:
        lost = int(self.job.ss.client.status().get("pending_losses", 0))
        return f"{lost} page loss(es) pending {when}" if lost else None

    def _copy(self, req: dict, box: list) -> str:
        """The copy the claim vouches for, into `box` (its only holder, so the staging can go):
        flat clones (CPU; GPU with room: device staging), or, on a GPU without room, the state
        dict in pinned host memory.  Returns where it went."""
        from leto_runtime import checkpoint
        ss = self.job.ss
        flats = [ss.flat(st)[:ss.layout.numel] for st in ss.model]
        if self.stream is None:
            for f in flats:
                self._check_stopping()
                box.append(f.clone())
            return "cpu"
        need = sum(f.numel() * 4 for f in flats)
        free, total = torch.cuda.mem_get_info(self.job.device)
        place, _ = staging_place(free, need, total)
        if place == "host":
            box.append(self._pinned(checkpoint.assemble(self.job, req, flats), cut=True))
            return place
        with torch.cuda.stream(self.stream):
            box.extend(f.clone() for f in flats)
        self.stream.synchronize()
        return place

    def _check_stopping(self) -> None:
        if self.stopping.is_set():
            raise RuntimeError("the shadow is taking over: the copy was cut short")

    def _pinned(self, state: dict, cut: bool = False) -> dict:
        """`state` with every CUDA tensor copied into a host tensor of its own, page-locked
        once and reused by every checkpoint of the job (fast copies, and nothing for DCP to
        copy again); pageable where the memory cannot be locked.  `cut`: a promotion stops
        the copy within `CUT_BYTES` of it (it reads retained memory)."""
        moved = [0]

        def walk(obj, path):
            if torch.is_tensor(obj) and obj.is_cuda:
                h = self.host.get(path)
                if h is None or h.shape != obj.shape or h.dtype != obj.dtype:
                    if h is not None:
                        _unlock(h)
                    h = self.host[path] = _page_locked(torch.empty(obj.shape, dtype=obj.dtype))
                h.copy_(obj, non_blocking=h.is_pinned())
                moved[0] += obj.numel() * obj.element_size()
                if cut and moved[0] >= CUT_BYTES:
                    moved[0] = 0
                    self.stream.synchronize()
                    self._check_stopping()
                return h
            if isinstance(obj, dict):
                return {k: walk(v, path + (k,)) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(walk(v, path + (i,)) for i, v in enumerate(obj))
            return obj
        with torch.cuda.stream(self.stream):
            out = walk(state, ())
        self.stream.synchronize()
        return out

    def _release_host(self) -> None:
        """Give the page-locked host copies back (after the last write, on promotion)."""
        for h in self.host.values():
            _unlock(h)
        self.host.clear()

    def _write(self, n: int, t: int, req: dict, box: list, place: str, copy_s: float) -> None:
        """After the claim: host copies, the checkpoint, the report -- in a thread of lowest
        CPU priority, so the write competes as little as it can with the active's CPU work.
        The active sends no request before this one's write is reported; a promotion stops
        waiting for it (the write goes on)."""
        with self.host_lock:
            self.write_busy = True
        mine = list(box)                    # the write's thread owns the copy from here
        box.clear()
        w = threading.Thread(target=_lowest_priority, args=(self._write_now, n, t, req, mine,
                                                            place, copy_s),
                             name=f"leto-snapshot-write-{t}", daemon=True)
        try:
            w.start()
        except BaseException:
            with self.host_lock:
                self.write_busy = False
            raise
        while w.is_alive() and not self.stopping.is_set():
            w.join(1.0)

    def _write_now(self, n: int, t: int, req: dict, box: list, place: str,
                   copy_s: float) -> None:
        from leto_runtime.ckpt_writer import describe_error, write_errors
        t0 = time.monotonic()
        info = {"ok": False, "error": "the shadow's write was interrupted", "write_s": 0.0}
        try:
            info = self._write_state(t, req, box, place, copy_s, t0)
        except write_errors() as e:          # (DCP's CheckpointException is no Exception)
            cause = describe_error(e)
            log(f"checkpoint of step {t}: the shadow's write failed ({cause})")
            info = {"ok": False, "error": cause, "write_s": time.monotonic() - t0}
        finally:
            self._drop(box, place)
            with self.host_lock:
                self.write_busy = False
                if self.stopping.is_set():
                    self._release_host()
            self._report(n, info)     # always: the active waits for it before its next request

    def _write_state(self, t: int, req: dict, box: list, place: str, copy_s: float,
                     t0: float) -> dict:
        from leto_runtime import checkpoint, ckpt_writer
        if place == "device":
            state = self._pinned(checkpoint.assemble(self.job, req, box))
            self._drop(box, place)
        elif place == "cpu":
            state = checkpoint.assemble(self.job, req, box)
        else:
            state = box[0]                    # pinned already, before the claim
        host_s = time.monotonic() - t0
        return ckpt_writer.write(state, t, self.settings, self.job.world_size,
                                 self.job._report_phase, self.job.faults.fire_in_thread,
                                 stall=None, why=req.get("why", ""),
                                 extra={"by": "shadow", "staging": place, "copy_s": copy_s,
                                        "host_s": host_s, "host_at": t0})

    def _report(self, n: int, info: dict) -> None:
        """The write's report, which the active waits for before its next request: retried on
        fresh clients (a shadow whose report is lost keeps the active's checkpoints off)."""
        for attempt in range(5):
            try:
                self.hs.report_written(self.epoch, n, info)     # (a fresh client after a fail)
                return
            except Exception as e:
                log(f"checkpoint write report {n}: the store did not take it "
                    f"({type(e).__name__}: {e})")
                time.sleep(0.5 * (attempt + 1))
        log(f"checkpoint write report {n} lost: the active gives up waiting for it after its "
            "cap and copies the state itself")


def _page_locked(t: torch.Tensor) -> torch.Tensor:
    try:
        from torch.cuda import _pin_memory_utils as pin
        pin.pin_memory(t.data_ptr(), t.numel() * t.element_size())
        t._leto_locked = True       # registered here: unregistered by `_release_host`
    except Exception:
        pass                # pageable: slower copies, the same bytes
    return t


def _unlock(t: torch.Tensor) -> None:
    if getattr(t, "_leto_locked", False):
        from torch.cuda import _pin_memory_utils as pin
        try:
            pin.unpin_memory(t.data_ptr())
        except Exception:
            pass
        t._leto_locked = False


def _lowest_priority(fn, *args) -> None:
    """A thread's body: this thread alone at nice 19, then `fn(*args)`.  Only in a thread of
    its own: Linux keeps a nice value per thread, and the main thread's would pass to every
    thread and process it starts later."""
    if threading.current_thread() is not threading.main_thread():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
    fn(*args)
