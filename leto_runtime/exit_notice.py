"""The trainer's side of the exit notice (`leto_runtime.wire.exit_page`): arm it at load, so
that an abrupt death tells the agent at the start of the exit; disarm it before any exit that
is not abrupt, so that the agent judges that one from the process's status.

`arm()` runs when `leto_runtime` is imported, in the main thread only (the mutex belongs to the
thread that locks it, and the main thread lives until the process ends).  It is a no-op without
`LETO_EXIT_NOTICE_FD` (not under leto-run, or turned off there), takes the fd out of the
environment and closes it (children neither inherit nor re-arm it), and registers `disarm` with
`atexit`, which runs for every interpreter exit (a return, `sys.exit`, an uncaught exception)
and never for a signal or `os._exit`.  Leto's own deliberate exits (`os._exit(86)`, a
demotion's self-kill) call `disarm()` first.

The exit fence (GPU machines, `LETO_EXIT_FENCE_FD`; leto_run/exit_notice.py says why): at load
the write end is moved to the lowest free fd -- below every device file CUDA opens later -- and
made close-on-exec, as CUDA's device files are: a forked child (a data-loader worker) holds
both, and the fence's EOF waits for it, as the release of the device files -- and so the end of
the context's work -- does.  `check_fence()`, called once the CUDA context and the process group exist, writes a
byte into it if a /dev/nvidia* fd sits below it (stdio closed before CUDA started, say): the
agent then waits for the reap instead of the EOF.  A trainer that never arms its notice closes
its fence: the agent uses a fence only after a notice.
"""
from __future__ import annotations

import atexit
import mmap
import os
import threading

from leto_runtime.wire import contract as C
from leto_runtime.wire import exit_page as X

_page: mmap.mmap | None = None
_fence: int | None = None


def _take_fence() -> int | None:
    """The fence's write end at the lowest free fd, or None (none given, or unusable)."""
    text = os.environ.pop(C.LETO_EXIT_FENCE_FD, None)
    if text is None:
        return None
    try:
        fd = int(text)
        low = os.dup(fd)               # the lowest free number
    except (ValueError, OSError):
        return None
    if low < fd:
        os.close(fd)
        fd = low
    else:
        os.close(low)
    os.set_inheritable(fd, False)
    return fd


def check_fence(devices: str | None = None) -> bool:
    """Whether the fence still sits below every device file (a path starting with `devices`,
    default the `LETO_DEVICE_FILES` prefix, /dev/nvidia) of this process; if not, say so to the
    agent (one byte) and drop it.  Idempotent; True without a fence."""
    global _fence
    fd = _fence
    if fd is None:
        return True
    if devices is None:
        from leto_runtime.wire import settings
        devices = settings.get().device_files
    from leto_runtime.wire.open_files import fds_under
    if not [n for n in fds_under(devices) if n < fd]:
        return True
    try:
        os.write(fd, b"!")
    except OSError:
        pass
    _fence = None                      # kept open: closing it now would be an early EOF
    return False


def arm() -> None:
    global _page, _fence
    if _page is not None:
        return
    page = _map_page()                 # its fd is closed first: no hole below the fence
    fence = _take_fence()
    if page is None or threading.current_thread() is not threading.main_thread() \
            or X.lock(page) != 0:
        if page is not None:
            page.close()
        if fence is not None:
            os.close(fence)            # unarmed: no notice, so no fence either
        return
    X.set_state(page, X.ARMED, os.getpid())
    _page = page
    atexit.register(disarm)
    _fence = fence


def _map_page() -> mmap.mmap | None:
    fd_text = os.environ.pop(C.LETO_EXIT_NOTICE_FD, None)
    if fd_text is None:
        return None
    try:
        return mmap.mmap(int(fd_text), X.PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (ValueError, OSError):
        return None                # no notice: the agent learns of the exit from its pidfd
    finally:
        try:
            os.close(int(fd_text))
        except (ValueError, OSError):
            pass


def page() -> mmap.mmap | None:
    """The armed exit page (the drain words live in it: `leto_runtime.drain`), or None."""
    return _page


def disarm() -> None:
    """This exit is deliberate: let the agent judge it by its status (idempotent)."""
    global _page
    page, _page = _page, None
    if page is not None and threading.current_thread() is threading.main_thread():
        X.set_state(page, X.CLEAN, os.getpid())
        X.unlock(page)
