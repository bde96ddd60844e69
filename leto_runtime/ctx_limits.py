"""A waiting shadow's CUDA context, made smaller (issue 21, "a smaller L3"; docs/PREINIT.md).

Role: most of a fresh CUDA context's device memory is the local-memory reservation the driver
makes for the per-thread stack: `CU_LIMIT_STACK_SIZE` bytes for every thread the device can
hold at once (2,048 a multiprocessor).  A shadow runs no kernel while it waits, so it lowers the
limit to `LETO_SHADOW_STACK` bytes (the driver still grows the reservation for any kernel that
needs more, as it does for every launch) and sets the driver's default back the moment it is
promoted, before its first kernel as an active: the promoted trainer's context is then the one
a trainer under torchrun has.  The figures are in docs/BENCHMARKS.md (benchmarks/shadow_footprint.py).

Calling contract: `shrink()` and `restore()` act on the calling thread's current context (the
device's primary context, which torch made current); both are no-ops without an initialized
CUDA device in this process or when the knob is `off`; `restore()` undoes only what `shrink()`
did and never raises (a failure is logged: the driver still grows the stack per kernel).
"""
from __future__ import annotations

import ctypes
import logging

from leto_runtime.wire import settings

LIMITS = {"stack": 0, "fifo": 1, "heap": 2}   # CUlimit: CU_LIMIT_STACK_SIZE, _PRINTF_FIFO_SIZE, _MALLOC_HEAP_SIZE
_saved: int | None = None        # the default shrink() replaced
_log = logging.getLogger("leto.ctx_limits")


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def get_limit(name: str) -> int:
    """A limit (`LIMITS`) of the calling thread's current context."""
    out = ctypes.c_size_t()
    rc = _driver().cuCtxGetLimit(ctypes.byref(out), ctypes.c_int(LIMITS[name]))
    if rc:
        raise OSError(f"cuCtxGetLimit({name}) = {rc}")
    return out.value


def set_limit(name: str, value: int) -> None:
    rc = _driver().cuCtxSetLimit(ctypes.c_int(LIMITS[name]), ctypes.c_size_t(value))
    if rc:
        raise OSError(f"cuCtxSetLimit({name}, {value}) = {rc}")


def get_stack() -> int:
    """The current context's stack limit, bytes per thread."""
    return get_limit("stack")


def set_stack(nbytes: int) -> None:
    set_limit("stack", nbytes)


def _cuda_up() -> bool:
    import torch
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def shrink() -> bool:
    """Lower the stack limit for the wait; True when it did."""
    global _saved
    want = settings.get().shadow_stack
    if want is None or _saved is not None or not _cuda_up():
        return False
    try:
        default = get_stack()
        if want >= default:
            return False
        set_stack(want)
    except OSError as e:
        _log.warning("leto: the shadow keeps its context's stack reservation (%s)", e)
        return False
    _saved = default
    return True


def restore() -> None:
    """Set the default back (promotion); idempotent."""
    global _saved
    default, _saved = _saved, None
    if default is None:
        return
    try:
        set_stack(default)
    except OSError as e:
        _log.warning("leto: the promoted trainer's stack limit stays at the shadow's (%s); "
                     "the driver grows it for each kernel that needs more", e)
