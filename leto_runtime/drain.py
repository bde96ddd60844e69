"""The trainer's drain words: what lets the agent promote a shadow before the driver has torn a
killed trainer's CUDA context down (issue 22, item 1; `leto_runtime.wire.exit_page` states the
rule, docs/ARCHITECTURE.md, "Exit notice", the whole order).

Why: a SIGKILLed trainer's queued kernels keep running until the driver destroys its context,
which the exit fence waits for (70-140 ms after the kill on the H100, whatever the kernels
still had to do).  Inside the RMU update the trainer itself knows everything it queued that may
write retained memory -- the update's kernels and copies, on the streams the updater owns --
and the host spends much of the phase waiting for the GPU (`Marker.settle` at its end).  A
death in such a wait needs no fence: once the streams have run what was queued, nothing of the
process can write retained memory again (none of its threads runs user code: the agent checks
that before it reads the words).

How: `open()` stores 0 into the exit page's `intent` before anything that the words do not
cover may be launched; `close()` queues, on every stream the drain knows, a stream-ordered
write of a new epoch e into that stream's `done` word (`cuStreamWriteValue64`, which also
fences memory system-wide before it writes), and only then stores e into `intent`.  A close
covers the work queued on those streams and whatever they wait for (events): every other
stream that writes retained memory is joined into the current stream before the update
(backward's streams by autograd, DDP's by its reducer, the updater's side copies by
`Updater.begin`, a reconstruction's by itself).  `Updater.step` owns the window: `begin()` at
its start, `close()` before each wait for the GPU and `open()` after it, `end()` before it
returns to the script (whose next launches -- the forward -- the words cannot cover).  Outside
`begin()`/`end()` a `close()` does nothing: a promoted trainer's finish follows writes of the
recovery that no stream of the drain orders.

The page is registered with CUDA (mapped, portable) once, at the first `close()`; its pages stay
pinned by the driver until the context is destroyed, so the GPU's writes after the trainer's
memory is gone still land in the page the agent maps.  Anything that fails (no exit page, no
libcuda, a registration or a write refused) turns the drain off for the process with one log
line: the fence then decides, as without it.

Calling contract: `for_device(device)` -> `Drain`, or `OFF` (CPU, not under leto-run,
`LETO_EXIT_DRAIN=0`, no exit page); `begin()`, `open()`, `close(streams)`, `end()` from the
thread that launches the update (the main thread).  Not thread-safe by design: one launching thread owns the words.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np

from leto_runtime.wire import exit_page as X

log = logging.getLogger("leto.drain")

_CU_MEMHOSTREGISTER_PORTABLE, _CU_MEMHOSTREGISTER_DEVICEMAP = 1, 2
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_NONE = object()
_drain = _NONE


def _driver():
    """The driver API's calls (not the runtime's: a refused one must not leave the runtime's
    sticky last error for torch's next launch check to trip on)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fns = []
    for names, args in ((("cuStreamWriteValue64_v2", "cuStreamWriteValue64"),
                         (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)),
                        (("cuMemHostRegister_v2", "cuMemHostRegister"),
                         (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)),
                        (("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
                         (ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint))):
        fn = getattr(lib, names[0], None) or getattr(lib, names[1])
        fn.argtypes, fn.restype = args, ctypes.c_int
        fns.append(fn)
    return fns


class Drain:
    def __init__(self, page):
        self.page = page                      # kept: the registered memory must stay mapped
        self.words = np.frombuffer(page, dtype=np.uint64, count=X.PAGE // 8)
        self.words32 = np.frombuffer(page, dtype=np.uint32, count=X.PAGE // 4)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
        self.epoch = 0
        self.slots: dict[int, int] = {}       # stream handle -> slot
        self.streams: list = []               # kept alive (torch pools its streams: a handle may
                                              # be shared, which only adds sentinels)
        self.dev_done = None                  # device address of the done words, once registered
        self.on = True
        self.owned = False
        self._write = None

    def begin(self) -> None:
        self.owned = True
        self.open()

    def end(self) -> None:
        self.owned = False
        self.open()

    def open(self) -> None:
        """From here on, launches may not be covered: a death now is not provable."""
        if self.on:
            self.words[X.INTENT_AT // 8] = 0

    def close(self, streams) -> None:
        """Everything queued so far on `streams` (and on every stream closed before) is covered
        by a new epoch; a death from here until the next `open()` is provable once those
        streams have run it."""
        if not (self.on and self.owned):
            return
        try:
            if self.dev_done is None:
                self._register()
            new = [s for s in streams if s is not None and s.cuda_stream not in self.slots]
            if new:
                self.words[X.INTENT_AT // 8] = 0       # the slot count changes under intent 0
                for s in new:
                    self._add(s)
            # the epoch is spent before any sentinel is queued: one queued by a close that did
            # not finish must never stand for work queued after it
            e = self.epoch = self.epoch + 1
            for s in self.streams:
                rc = self._write(ctypes.c_void_p(s.cuda_stream),
                                 self.dev_done + 8 * self.slots[s.cuda_stream], e, 0)
                if rc != 0:
                    raise OSError(f"cuStreamWriteValue64: CUresult {rc}")
        except BaseException as exc:                # the fence decides from now on
            self.off(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
            return
        self.words[X.INTENT_AT // 8] = e           # one aligned 8-byte store: never torn

    def _add(self, stream) -> None:
        if len(self.streams) >= X.MAX_SLOTS:
            raise OSError(f"more than {X.MAX_SLOTS} streams")
        self.slots[stream.cuda_stream] = len(self.streams)
        self.streams.append(stream)
        self.words32[X.SLOTS_AT // 4] = len(self.streams)

    def _register(self) -> None:
        self._write, register, devptr = _driver()
        rc = register(ctypes.c_void_p(self.addr), X.PAGE,
                      _CU_MEMHOSTREGISTER_DEVICEMAP | _CU_MEMHOSTREGISTER_PORTABLE)
        if rc not in (0, _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            raise OSError(f"cuMemHostRegister: CUresult {rc}")
        dev = ctypes.c_uint64()
        rc = devptr(ctypes.byref(dev), ctypes.c_void_p(self.addr), 0)
        if rc != 0:
            raise OSError(f"cuMemHostGetDevicePointer: CUresult {rc}")
        self.dev_done = dev.value + X.DONE_AT

    def off(self, why: str) -> None:
        if self.on:
            self.words[X.INTENT_AT // 8] = 0
            self.on = False
            log.warning("leto.drain: off for this process (%s); a death waits for the exit "
                        "fence", why)


class _Off:
    """Where the drain cannot apply: every call does nothing (the fence decides)."""
    on = False

    def begin(self) -> None: ...
    def end(self) -> None: ...
    def open(self) -> None: ...
    def close(self, streams) -> None: ...


OFF = _Off()


def for_device(device) -> "Drain | _Off":
    """The process's drain (one per process: one exit page), or OFF where it cannot apply."""
    global _drain
    if _drain is _NONE:
        _drain = _make(device) or OFF
    return _drain


def _make(device) -> Drain | None:
    import torch
    from leto_runtime import exit_notice
    from leto_runtime.wire import settings
    if torch.device(device).type != "cuda" or not settings.get().exit_drain:
        return None
    page = exit_notice.page()
    return Drain(page) if page is not None else None
