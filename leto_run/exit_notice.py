"""The agent's side of the exit notice (`leto_runtime.wire.exit_page`; issue 22, item 1): learn
that a trainer's exit has begun, before the kernel tore it down and its pidfd fires.

Role: `ExitNotices.page()` creates a trainer's page before its spawn (the fd goes to the child
through `pass_fds`, its number in `LETO_EXIT_NOTICE_FD`); `watch(pid, page)` starts one waiter
thread for it.  The thread waits until the trainer armed the page, then in the mutex (1 s
slices, so `close` ends it); `EOWNERDEAD` means the trainer's main thread died holding it.
Then `verified_exit` reads, from /proc, what the kernel set before it released the mutex: every
thread of the process is past `PF_EXITING` (none runs user code or a system call any more, so
none writes retained memory from the CPU) and the exit status waitpid will report.  A verified
notice is posted as (pid, exitcode, mono) to a pipe the agent's selector watches (`fd`,
`drain`); anything unverified is dropped, and the pidfd decides, as without a notice.

What the agent does with it (`leto_run.supervisor.Supervisor.on_exit_notices`): where `acts` --
no NVIDIA device on this machine -- the active is judged failed at once and counts as stopped
(its recovery does not wait for its reap).  On a GPU machine the dead process's kernels run on
until the driver tears its context down, later in the exit, so there the notice is only
recorded (`exit_started` event) and the pidfd still decides: promoting before that teardown is
proven harmless on the device would risk retained memory.

Calling contract: the agent's main thread calls everything but the waiters; the waiters only
read their page and write to the pipe (no lock is shared with the main thread).
"""
from __future__ import annotations

import mmap
import os
import threading
import time

from leto_run.procs import stat_fields
from leto_runtime.wire import exit_page as X

PF_EXITING = 0x4
ARM_POLL_S = 0.05          # how often a waiter looks whether its trainer armed the page
WAIT_SLICE_S = 1.0         # one bounded wait in the mutex
VERIFY_S = 0.05            # how long the threads of a dying process may take to reach do_exit


def verified_exit(pid: int, deadline_s: float = VERIFY_S) -> int | None:
    """The exit status of `pid` (Popen's convention: -signal, or the code) once every thread
    of it is exiting; None if that cannot be shown within `deadline_s` (or the status reads
    0: then nothing says it died abruptly)."""
    end = time.monotonic() + deadline_s
    while True:
        status = _exit_status(pid)
        if status is not None and _all_exiting(pid):
            return status
        if time.monotonic() >= end:
            return None
        time.sleep(0.0002)


def _exit_status(pid: int) -> int | None:
    f = stat_fields(f"/proc/{pid}/stat")
    if f is None or len(f) < 50:
        return None
    code = int(f[49])                              # field 52: exit_code, waitpid's form
    if code == 0:
        return None
    return -(code & 0x7F) if code & 0x7F else (code >> 8) & 0xFF


def _all_exiting(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        f = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if f is not None and len(f) > 6 and not int(f[6]) & PF_EXITING:   # field 9: flags
            return False
    return True


def machine_has_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl")


class ExitNotices:
    def __init__(self, enabled: bool, acts: bool | None = None) -> None:
        self.enabled = enabled
        self.acts = (not machine_has_gpu()) if acts is None else acts
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._pages: dict[int, mmap.mmap] = {}

    @property
    def fd(self) -> int:
        return self._r

    def page(self) -> tuple[int, mmap.mmap] | None:
        """(fd for the child, the mapped page) for the next spawn; None when turned off."""
        if not self.enabled:
            return None
        fd = os.memfd_create("leto-exit-notice", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, X.PAGE)
            page = mmap.mmap(fd, X.PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            X.init_mutex(page)
        except BaseException:
            os.close(fd)
            raise
        return fd, page

    def watch(self, pid: int, page: mmap.mmap) -> None:
        self._pages[pid] = page
        threading.Thread(target=self._wait, args=(pid, page), daemon=True,
                         name=f"leto-exit-notice-{pid}").start()

    def forget(self, pid: int) -> None:
        """`pid` was reaped: its waiter ends within a slice (the page is unmapped then)."""
        self._pages.pop(pid, None)

    def _wait(self, pid: int, page: mmap.mmap) -> None:
        try:
            while not self._stop.is_set() and pid in self._pages:
                state, armer = X.state(page)
                if state == X.CLEAN:
                    return
                if state != X.ARMED or armer != pid:
                    time.sleep(ARM_POLL_S)
                    continue
                rc = X.timedlock(page, WAIT_SLICE_S)
                if rc == 0:                    # released cleanly: the pidfd judges the exit
                    X.unlock(page)
                    return
                if rc == X.EOWNERDEAD:
                    mono = time.monotonic()
                    status = verified_exit(pid)
                    if status is not None:
                        try:
                            os.write(self._w, f"{pid} {status} {mono!r}\n".encode())
                        except OSError:
                            pass               # the pipe is full or closed: the pidfd decides
                    return
        finally:
            page.close()

    def drain(self) -> list[tuple[int, int, float]]:
        out = []
        while True:
            try:
                data = os.read(self._r, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            for line in data.decode().splitlines():
                pid, status, mono = line.split()
                out.append((int(pid), int(status), float(mono)))
        return out

    def close(self) -> None:
        """Stop the waiters (within a slice).  The write end stays open until the process
        ends: a waiter still running must never write to a reused fd number."""
        self._stop.set()
        self._pages.clear()
        try:
            os.close(self._r)
        except OSError:
            pass
