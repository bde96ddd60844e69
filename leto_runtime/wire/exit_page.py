"""The exit-notice page: one shared page per trainer process through which its agent learns
that the process's exit has *begun*, before the kernel has torn it down (issue 22, item 1;
docs/ARCHITECTURE.md, "Exit notice").

Mechanism: a POSIX robust, process-shared mutex in a memfd page the agent creates and the
trainer inherits (fd `LETO_EXIT_NOTICE_FD`).  The trainer's main thread locks it at load
(`state` ARMED); the agent waits on it.  When the thread dies holding it -- a signal,
`os._exit`, an abort -- the kernel releases it with OWNER_DIED while it walks the thread's
robust list, early in the exit (`exit_mm_release`, before memory and files are torn down),
and the agent's wait returns `EOWNERDEAD`.  A trainer that ends cleanly (interpreter exit,
or an exit Leto itself decides) unlocks it first (`state` CLEAN): the agent then learns of the
exit from the process's pidfd, with its status, as before.

Layout: bytes [0, 64) the mutex (glibc's `pthread_mutex_t` is 40 bytes on x86-64, 48 on
aarch64), [64, 68) `state` (u32), [68, 72) the pid that armed it; the drain words (GPU
trainers, `leto_runtime.drain`): [128, 136) `intent` (u64), [136, 140) the stream slots in use
(u32), [192, 256) `done`, one u64 per slot.

The drain proof (issue 22, item 1): a dead trainer's device work has provably stopped writing
retained memory when `intent` is an epoch e != 0 and every slot's `done` is e.  The trainer
stores 0 into `intent` before it launches anything that may write retained memory, and e only
after it queued, on every stream it launches such work on, a stream-ordered write of e into that
stream's `done` word (`cuStreamWriteValue64`: it runs once everything queued before it on that
stream has finished).  So `done == intent` on every slot, read once no thread of the process
runs user code any more (the agent's `verified_exit`), means that every retained-memory write the
process ever queued has happened.  `drain_verdict` is that rule.  Both sides use glibc through
ctypes (no build step; `pthread_*` live in libc since glibc 2.34, and in libpthread before).

Calling contract: `init_mutex(buf)` once (the agent, before the spawn); `lock`/`unlock` from
the trainer's main thread; `timedlock(buf, seconds)` from the agent's waiter thread (ctypes
releases the GIL).  Returns are errno values (0, ETIMEDOUT, EOWNERDEAD, ...).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import struct
import time

PAGE = 4096
MUTEX_BYTES = 64
STATE_AT, PID_AT = 64, 68
NOT_ARMED, ARMED, CLEAN = 0, 1, 2
INTENT_AT, SLOTS_AT, DONE_AT, MAX_SLOTS = 128, 136, 192, 8
EOWNERDEAD = errno.EOWNERDEAD
_PSHARED, _ROBUST = 1, 1          # PTHREAD_PROCESS_SHARED, PTHREAD_MUTEX_ROBUST


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LIB = None


def _lib():
    global _LIB
    if _LIB is None:
        libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(libc, "pthread_mutexattr_setrobust"):
            libc = ctypes.CDLL(ctypes.util.find_library("pthread"), use_errno=True)
        for name in ("pthread_mutex_lock", "pthread_mutex_unlock", "pthread_mutex_init",
                     "pthread_mutex_timedlock", "pthread_mutexattr_init",
                     "pthread_mutexattr_setpshared", "pthread_mutexattr_setrobust"):
            getattr(libc, name).restype = ctypes.c_int
        _LIB = libc
    return _LIB


def _addr(buf: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view                  # no export left: the page can be unmapped later


def init_mutex(buf: mmap.mmap) -> None:
    """A fresh robust, process-shared mutex at the page's start; `state` NOT_ARMED."""
    L = _lib()
    attr = ctypes.create_string_buffer(16)
    for rc in (L.pthread_mutexattr_init(attr), L.pthread_mutexattr_setpshared(attr, _PSHARED),
               L.pthread_mutexattr_setrobust(attr, _ROBUST),
               L.pthread_mutex_init(ctypes.c_void_p(_addr(buf)), attr)):
        if rc != 0:
            raise OSError(rc, f"exit-notice mutex: {errno.errorcode.get(rc, rc)}")
    set_state(buf, NOT_ARMED, 0)


def lock(buf: mmap.mmap) -> int:
    return _lib().pthread_mutex_lock(ctypes.c_void_p(_addr(buf)))


def unlock(buf: mmap.mmap) -> int:
    return _lib().pthread_mutex_unlock(ctypes.c_void_p(_addr(buf)))


def timedlock(buf: mmap.mmap, seconds: float) -> int:
    """Wait at most `seconds` for the mutex (glibc measures against CLOCK_REALTIME)."""
    end = time.time() + seconds
    ts = _Timespec(int(end), int((end % 1) * 1e9))
    return _lib().pthread_mutex_timedlock(ctypes.c_void_p(_addr(buf)), ctypes.byref(ts))


def set_state(buf: mmap.mmap, state: int, pid: int) -> None:
    buf[STATE_AT:PID_AT + 4] = struct.pack("<II", state, pid)


def state(buf: mmap.mmap) -> tuple[int, int]:
    return struct.unpack("<II", buf[STATE_AT:PID_AT + 4])


def drain_words(buf) -> tuple[int, list[int]]:
    """(intent, done of every slot in use) as the page holds them now (more slots than
    MAX_SLOTS read as that many + 1 zeros: unprovable)."""
    intent, n = struct.unpack_from("<QI", buf, INTENT_AT)
    if n > MAX_SLOTS:
        return intent, [0] * (MAX_SLOTS + 1)
    return intent, list(struct.unpack_from(f"<{n}Q", buf, DONE_AT))


def drain_verdict(intent: int, done: list[int]) -> tuple[str, str]:
    """("drained" | "pending" | "unprovable", why) for a dead trainer's drain words: drained
    when every slot's done word reached the epoch `intent` names; pending while some is below
    it (its stream still runs work queued before the sentinel); unprovable otherwise (it died
    while launching, outside the update, or the words make no sense)."""
    if intent == 0:
        return "unprovable", "it was launching work the drain words do not cover"
    if not done or len(done) > MAX_SLOTS:
        return "unprovable", f"{len(done)} stream slots (1 to {MAX_SLOTS} can be proven)"
    if any(d > intent for d in done):
        return "unprovable", f"a done word is past the intent {intent}: {done}"
    if all(d == intent for d in done):
        return "drained", f"every stream reached epoch {intent}"
    return "pending", f"streams at {done}, epoch {intent}"
