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
"""
from __future__ import annotations

import atexit
import mmap
import os
import threading

from leto_runtime.wire import contract as C
from leto_runtime.wire import exit_page as X

_page: mmap.mmap | None = None


def arm() -> None:
    global _page
    fd_text = os.environ.pop(C.LETO_EXIT_NOTICE_FD, None)
    if _page is not None or fd_text is None:
        return
    try:
        fd = int(fd_text)
        page = mmap.mmap(fd, X.PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (ValueError, OSError):
        return                     # no notice: the agent learns of the exit from its pidfd
    finally:
        try:
            os.close(int(fd_text))
        except (ValueError, OSError):
            pass
    if threading.current_thread() is not threading.main_thread() or X.lock(page) != 0:
        page.close()
        return
    X.set_state(page, X.ARMED, os.getpid())
    _page = page
    atexit.register(disarm)


def disarm() -> None:
    """This exit is deliberate: let the agent judge it by its status (idempotent)."""
    global _page
    page, _page = _page, None
    if page is not None and threading.current_thread() is threading.main_thread():
        X.set_state(page, X.CLEAN, os.getpid())
        X.unlock(page)
