"""In-process demotion (`--demote release`): a surviving active of a HOF releases its GPU memory
and process group and becomes the shadow of generation g+2 -- in the same process, so its
imports and CUDA context (level L2) are kept and only its process group (L3) is formed again.

Protocol (agent side in `leto_run.inplace`): the agent sends `contract.DEMOTE_SIGNAL` to every
surviving active of generation g, waits (bounded) for each one's `demoted` datagram, and only
then sets the go keys of g+1: no process of generation g touches retained memory afterwards.  A
survivor that does not confirm in time is SIGKILLed and replaced (as with `demote=replace`).

What happens in the trainer:
1. The signal handler only records the request (it never raises at an arbitrary bytecode: a
   `finally` or a half-done library call could then write retained memory in an order RMU does
   not know).  A thread woken through `signal.set_wakeup_fd` aborts the process group, so a main
   thread blocked inside a collective with the dead peer returns (NCCL would wait forever).
2. The runtime raises `Demoted` at its next safe point: every injection point (`Faults.fire`:
   step start, gradient all-reduce, protection, the global sync, each RMU operation, each
   recovery phase), which are exactly the points where a kill is tested to be recoverable;
   or when one of the runtime's collectives fails because of the aborted group or dead peer.
3. `Demoted` is a BaseException (like KeyboardInterrupt): the script's `except Exception`
   handlers let it through, and it leaves the script.  The interpreter hands it to
   `sys.excepthook`, installed here: the frames of the old run are cleared, `Job.release()`
   drops the parameters' views, unmaps the retained states and destroys the process group, the
   device is synchronized (no queued kernel may write retained memory after the confirmation),
   the caching allocator's memory is returned, the environment is rewritten to the shadow of g+2
   (`contract.demoted_env`) and the `demoted` datagram is sent.
4. The script is run again in this process as `__main__` (`runpy`), now as a shadow: `init()`
   forms the new generation's process group and `job.steps()` blocks until promotion.  When that
   run ends, the process exits as the interpreter would (atexit handlers, exit status).

Calling contract: `install(ctx)` once from `leto_runtime.init()` in in-place mode when
`ctx.demote == "release"` (idempotent; needs the main thread); `arm(job)` when the process
becomes an active (at init, or at promotion); `check()` at safe points (cheap); `on_error(exc)`
from the runtime's collectives (returns when the error has nothing to do with a demotion, so the
caller re-raises).  Scripts that install their own `sys.excepthook` or wakeup fd keep it: then
the demotion falls back to the agent's SIGKILL (logged).
"""
from __future__ import annotations

import gc
import os
import runpy
import signal
import sys
import threading
import time
import traceback

from leto_runtime import beats
from leto_runtime.wire import contract as C
from leto_runtime import runtime

RELEASE_GRACE_S = 5.0     # after a collective fails: how long a demote signal may take to arrive


class Demoted(BaseException):
    """Raised at a safe point after the agent asked this active to demote itself."""


class State:
    """The process's demotion state (kept in `runtime.current().demotion`)."""

    def __init__(self) -> None:
        self.installed = False
        self.armed = False
        self.job = None
        self.requested: float | None = None        # monotonic time the demote signal arrived
        self.event = threading.Event()
        self.aborted = threading.Event()           # the wake thread finished its abort attempt
        self.main_spec: tuple[str, str] | None = None   # ("path", file) or ("module", name)
        self.prev_hook = None
        self.wake_ok = False
        self.finished = False


def _st() -> State:
    rt = runtime.current()
    if rt.demotion is None:
        rt.demotion = State()
    return rt.demotion


def _log(msg: str) -> None:
    from leto_runtime.context import Context
    ctx = Context.from_env()
    sys.stderr.write(f"[leto_runtime rank={ctx.rank} role={ctx.role} gen={ctx.generation}] "
                     f"{msg}\n")
    sys.stderr.flush()


def _main_spec() -> tuple[str, str] | None:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        return ("module", spec.name)
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path else None


def install(ctx) -> bool:
    """Arm the machinery (see the module docstring); False where this process cannot demote
    itself (then the agent's SIGKILL fallback applies)."""
    S = _st()
    if S.installed:
        return S.wake_ok
    if threading.current_thread() is not threading.main_thread():
        return False
    S.installed = True
    S.main_spec = _main_spec()
    if S.main_spec is None:
        _log("demote=release: cannot tell how this script was started (no __main__ file or "
             "module); a demotion falls back to the agent's SIGKILL")
        return False
    signal.signal(C.DEMOTE_SIGNAL, _on_signal)
    r, w = os.pipe()
    os.set_blocking(w, False)
    prev = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if prev != -1:
        # The script (or asyncio) owns the wakeup fd: give it back; a blocked collective is
        # then only left through its own timeout, and the agent's bound decides.
        signal.set_wakeup_fd(prev)
        os.close(r)
        os.close(w)
        _log("demote=release: the signal wakeup fd is taken by the script; a survivor blocked "
             "in a collective may be killed by the agent instead of demoted")
    else:
        threading.Thread(target=_wake_loop, args=(r,), name="leto-demote", daemon=True).start()
    S.prev_hook = sys.excepthook
    sys.excepthook = _excepthook
    S.wake_ok = True
    return True


def arm(job) -> None:
    """This process is an active now: a demote signal applies to it."""
    S = _st()
    S.job, S.armed = job, True


def finished() -> None:
    """The training loop ended: nothing is left to demote.  A demote signal from now on (a HOF
    of a peer during this rank's teardown) ends the process, as `replace` would."""
    S = _st()
    S.armed, S.finished = False, True


def requested() -> bool:
    S = _st()
    return S.requested is not None


def check() -> None:
    """A safe point: raise `Demoted` if the agent asked for it."""
    S = _st()
    if S.requested is not None and S.armed:
        raise Demoted(f"demoted by the agent {time.monotonic() - S.requested:.3f} s ago")


def on_error(exc: BaseException) -> None:
    """A runtime collective failed: if a demotion is (about to be) asked for -- the dead peer
    made it fail -- raise `Demoted` from it; else return and let the caller re-raise."""
    S = _st()
    if not (S.installed and S.armed):
        return
    if isinstance(exc, Demoted):
        raise exc
    if S.requested is not None or (_distributed(exc) and S.event.wait(RELEASE_GRACE_S)):
        raise Demoted("demoted by the agent after a collective failed") from exc


def _on_signal(signum, frame) -> None:
    # Records only (see the module docstring, step 1); raising here could tear library state.
    S = _st()
    if S.armed and S.requested is None:
        S.requested = time.monotonic()
        S.event.set()


def _wake_loop(fd: int) -> None:
    S = _st()
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if C.DEMOTE_SIGNAL in data and S.finished:
            os.kill(os.getpid(), signal.SIGKILL)
        if C.DEMOTE_SIGNAL in data and S.armed:
            if S.requested is None:
                S.requested = time.monotonic()
            S.event.set()
            _abort_process_group()
            S.aborted.set()


def _abort_process_group() -> None:
    """Make a collective blocked on the dead peer return (NCCL would spin forever; gloo would
    wait for its timeout).  The group belongs to generation g, which is over."""
    try:
        import torch.distributed as dist
        if not dist.is_initialized():
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
        else:
            dist.group.WORLD.abort()
    except Exception as e:      # an abort that is not supported leaves the timeout to decide
        _log(f"process group abort failed ({type(e).__name__}: {e})")


def _looks_demoted(exc: BaseException) -> bool:
    S = _st()
    if isinstance(exc, Demoted) or S.requested is not None:
        return True
    # An error out of the script's own collective can precede the signal by a few ms; any
    # other error is the script's own and leaves at once.
    return S.armed and _distributed(exc) and S.event.wait(RELEASE_GRACE_S)


def _distributed(exc: BaseException) -> bool:
    try:
        import torch.distributed as dist
        if isinstance(exc, dist.DistError):
            return True
    except Exception:
        pass
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        w in text for w in ("gloo", "nccl", "connection", "closed", "abort", "peer"))


def _excepthook(tp, value, tb) -> None:
    S = _st()
    if not (S.armed and _looks_demoted(value)):
        return (S.prev_hook or sys.__excepthook__)(tp, value, tb)
    _clear(value, tb)
    del value, tb
    sys.last_type = sys.last_value = sys.last_traceback = None
    _become_shadow()


def _clear(value, tb) -> None:
    """Drop every local of the old run (models, tensors, the job) held by the traceback."""
    seen = set()
    while value is not None and id(value) not in seen:
        seen.add(id(value))
        traceback.clear_frames(value.__traceback__)
        value = value.__cause__ or value.__context__
    traceback.clear_frames(tb)
    main = sys.modules.get("__main__")
    if main is not None:
        keep = {k: main.__dict__[k] for k in ("__name__", "__builtins__", "__spec__",
                                             "__file__", "__loader__", "__package__")
                if k in main.__dict__}
        main.__dict__.clear()
        main.__dict__.update(keep)


def _become_shadow() -> None:
    S = _st()
    code = 0
    while True:
        t0 = S.requested or time.monotonic()
        job = S.job
        old_gen = job.ctx.generation if job is not None else None
        t_left = time.monotonic()
        if S.wake_ok:
            S.aborted.wait(2.0)      # never destroy the group while the wake thread aborts it
        t_abort = time.monotonic()
        detail, old = runtime.current().release_job()
        detail.update(left_s=t_left - t0, abort_wait_s=t_abort - t_left,
                      release_s=time.monotonic() - t_abort)
        S.job, S.armed, S.requested = None, False, None
        S.event.clear()
        S.aborted.clear()
        gen = (old_gen if old_gen is not None else 0) + 2
        os.environ.update(C.demoted_env(gen))
        beats.rebind()
        detail.update(seconds=time.monotonic() - t0, mono=time.monotonic(), generation=gen)
        import json
        beats.send("demoted", None, json.dumps(detail))
        if old is not None:
            old.release_group()
        del old, job
        collect_memory()
        _log(f"demoted in process: released in {detail['seconds'] * 1e3:.1f} ms; now the "
             f"shadow of generation {gen}")
        try:
            kind, name = S.main_spec
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(name, run_name="__main__")
            code = 0
        except Demoted:
            continue
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException as e:
            if S.armed and _looks_demoted(e):
                _clear(e, e.__traceback__)
                del e
                continue
            (S.prev_hook or sys.__excepthook__)(type(e), e, e.__traceback__)
            code = 1
        break
    _exit(code)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    sys.stderr.write(f"{e.code}\n")
    return 1


def _exit(code: int) -> None:
    """End the process as the interpreter would after the script: atexit, flush, status."""
    import atexit
    try:
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os._exit(code)


def release_memory(device) -> dict:
    """Synchronize `device` and return the caching allocator's free memory; figures for the
    `demoted` datagram."""
    out: dict = {}
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch
        out["gpu_reserved_before"] = int(torch.cuda.memory_reserved(device))
        torch.cuda.synchronize(device)     # no queued kernel writes retained memory later
        torch.cuda.empty_cache()
        out["gpu_reserved_after"] = int(torch.cuda.memory_reserved(device))
    return out


def collect_memory() -> None:
    """After the confirmation: what only a cycle still held (hooks closing over the old job,
    frames) goes too."""
    gc.collect()
    try:
        import torch
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass
