"""The agent's side of the exit notice (`leto_runtime.wire.exit_page`; issue 22, item 1): learn
that a trainer's exit has begun, before the kernel tore it down and its pidfd fires; and, on a
GPU machine, when the dead process's device work has stopped (the exit fence).

Role: `ExitNotices.page()` creates a trainer's page before its spawn (the fd goes to the child
through `pass_fds`, its number in `LETO_EXIT_NOTICE_FD`), `fence()` its fence pipe (the write
end goes to the child, `LETO_EXIT_FENCE_FD`); `watch(pid, page, fence_r)` starts one waiter
thread for it.  The thread waits until the trainer armed the page, then in the mutex (1 s
slices, so `close` ends it); `EOWNERDEAD` means the trainer's main thread died holding it.
Then `verified_exit` reads, from /proc, what the kernel set before it released the mutex: every
thread of the process is past `PF_EXITING` (none runs user code or a system call any more, so
none writes retained memory from the CPU) and the exit status waitpid will report.  A verified
notice is posted as (pid, exitcode, mono, "began") to a pipe the agent's selector watches
(`fd`, `drain`); anything unverified is dropped, and the pidfd decides, as without a notice.

The fence (GPU machines): the robust mutex is released early in `do_exit` (exit_mm), but the
driver destroys the process's CUDA context -- and so stops its kernels, which may still be
writing retained memory -- only when its device files are released, after exit_files.  The
kernel releases a dying task's files last-opened-fd-first (close_files walks the fds upward and
each release is queued as task work, which runs newest first), so the write end of a pipe held
at an fd *below* every /dev/nvidia* fd is released after them: its EOF says the context is gone.
The trainer moves the write end to its lowest free fd before CUDA opens anything and writes a
byte into it if a device fd ever sits below it (`leto_runtime.exit_notice.check_fence`).  The
agent's selector watches the read end (`fence_verdict`): EOF with nothing written, while the
process is exiting, is "quiet"; a byte, or an EOF while the process lives (the trainer closed
it), makes the fence "untrusted", and the reap decides when the promotion may write, as before
-- with the orphans that still hold a device file killed and waited for first
(`WorkerGroup.stop_device_strays`: a forked child keeps the dead trainer's context alive).
`benchmarks/exit_fence.py` measures the order on the GPU (docs/BENCHMARKS.md).

The drain words (GPU machines, `LETO_EXIT_DRAIN`): after a verified notice the waiter also
reads the dead trainer's drain words (`leto_runtime/drain.py`) every DRAIN_POLL_S and posts
(pid, exitcode, mono, "drained") once they prove every retained-memory write it queued done
(`exit_page.drain_verdict`); the supervisor then counts it as stopped before its fence.

What the agent does with it (`leto_run.supervisor.Supervisor`): an active is judged failed at
the notice ("began"), so the recovery's CPU-side work starts at once; it counts as stopped --
nothing of it can write retained memory, and the promotion may go on -- at once where the
machine has no NVIDIA device, else once its fence is quiet or it is reaped.

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
DRAIN_POLL_S = 0.0002      # how often a waiter reads a dead trainer's drain words
DRAIN_WAIT_S = 2.0         # ... and for how long at most (the fence or the reap decides anyway)


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


def exiting(pid: int) -> bool:
    """`pid` is past the start of its exit (or gone): its leader has PF_EXITING, or it is a
    zombie."""
    f = stat_fields(f"/proc/{pid}/stat")
    if f is None:
        return True
    return f[0] in ("Z", "X") or bool(int(f[6]) & PF_EXITING)


ROOM_SLACK = 256 << 20     # what the promoted trainer may need beyond what the dead one held


def room_beside_the_dead(free: int, held: int) -> tuple[bool, str]:
    """A dead trainer still holding `held` bytes of its device (until the driver's teardown)
    while `free` bytes are free: may its replacement start now, or would it run out of memory
    growing to the dead one's footprint?  (ok, why)."""
    if free >= held + ROOM_SLACK:
        return True, f"{free >> 20} MiB free beside the dead process's {held >> 20} MiB"
    return False, (f"only {free >> 20} MiB free while the dead process still holds "
                   f"{held >> 20} MiB: wait for the driver to free it")


def fence_verdict(fd: int, pid: int) -> str | None:
    """Read the fence `fd` of `pid` (readable): "quiet" -- EOF, with nothing ever written, at
    an exit --, "untrusted" -- the trainer flagged it, or it was closed while `pid` lived --,
    or None (nothing to read yet)."""
    try:
        data = os.read(fd, 4096)
    except (BlockingIOError, InterruptedError):
        return None
    if data:
        return "untrusted"
    return "quiet" if exiting(pid) else "untrusted"


class ExitNotices:
    """`gpu`: a dead trainer's device work may outlive its notice, so it counts as stopped only
    at "quiet" or its reap (default: the machine has an NVIDIA device); `fence`: give trainers
    fences ("quiet" needs one)."""

    def __init__(self, enabled: bool, gpu: bool | None = None, fence: bool = True,
                 drain: bool = True) -> None:
        self.enabled = enabled
        self.gpu = machine_has_gpu() if gpu is None else gpu
        self.use_fence = fence
        self.use_drain = drain
        # pids whose trainer armed its notice -- and so took its fence below its device files
        # (leto_runtime.exit_notice); a fence of any other process is never trusted
        self.armed: set[int] = set()
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._pages: dict[int, mmap.mmap] = {}
        # pid -> the token of its latest watch: a waiter's posts carry its token, and `drain`
        # drops those of an earlier process whose pid a new spawn reused
        self._tokens: dict[int, int] = {}
        self._seq = 0
        self._nvml = None

    @classmethod
    def from_settings(cls, knobs) -> "ExitNotices":
        """The agent's: LETO_EXIT_NOTICE, LETO_EXIT_FENCE (auto / on / off), LETO_EXIT_DRAIN."""
        return cls(knobs.exit_notice, gpu=True if knobs.exit_fence == "on" else None,
                   fence=knobs.exit_fence != "off", drain=knobs.exit_drain)

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

    def fence(self) -> tuple[int, int] | None:
        """(read end for the agent's selector, write end for the child) of the next spawn's
        fence pipe, on a GPU machine with notices on; None otherwise."""
        if not (self.enabled and self.gpu and self.use_fence):
            return None
        r, w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(r, False)
        return r, w

    def watch(self, pid: int, page: mmap.mmap) -> None:
        self._seq += 1
        self._pages[pid], self._tokens[pid] = page, self._seq
        threading.Thread(target=self._wait, args=(pid, page, self._seq), daemon=True,
                         name=f"leto-exit-notice-{pid}").start()

    def forget(self, pid: int) -> None:
        """`pid` was reaped: its waiter ends within a slice (the page is unmapped then)."""
        self._pages.pop(pid, None)

    def _post(self, pid: int, status: int, mono: float, kind: str, token: int) -> None:
        try:
            os.write(self._w, f"{pid} {status} {mono!r} {kind} {token}\n".encode())
        except OSError:
            pass                       # the pipe is full or closed: the pidfd decides

    def _wait(self, pid: int, page: mmap.mmap, token: int) -> None:
        try:
            while not self._stop.is_set() and self._pages.get(pid) is page:
                state, armer = X.state(page)
                if state == X.CLEAN:
                    return
                if state != X.ARMED or armer != pid:
                    time.sleep(ARM_POLL_S)
                    continue
                self.armed.add(pid)
                rc = X.timedlock(page, WAIT_SLICE_S)
                if rc == 0:                    # released cleanly: the pidfd judges the exit
                    X.unlock(page)
                    return
                if rc == X.EOWNERDEAD:
                    mono = time.monotonic()
                    status = verified_exit(pid)
                    if status is not None:
                        self._post(pid, status, mono, "began", token)
                        if self.gpu and self.use_drain:
                            self._await_drain(pid, page, status, token)
                    return
        finally:
            page.close()

    def _await_drain(self, pid: int, page: mmap.mmap, status: int, token: int) -> None:
        """After a verified notice (no thread of `pid` runs user code: its drain words are
        final but for the GPU's own writes): post "drained" once they prove its queued device
        work done (`exit_page.drain_verdict`) and its device has room for what the dead
        process still holds until the driver frees it (`room`); give up when they cannot, at
        the reap or after DRAIN_WAIT_S."""
        end = time.monotonic() + DRAIN_WAIT_S
        while self._pages.get(pid) is page and not self._stop.is_set() \
                and time.monotonic() < end:
            verdict, _ = X.drain_verdict(*X.drain_words(page))
            if verdict == "unprovable":
                return
            if verdict == "drained" and self.room(pid)[0]:
                self._post(pid, status, time.monotonic(), "drained", token)
                return
            time.sleep(DRAIN_POLL_S)

    def room(self, pid: int) -> tuple[bool, str]:
        """Whether a promoted trainer can grow to what `pid` held on its device while the dead
        context still holds it (`room_beside_the_dead`, from NVML); no NVML: no room claimed
        (the fence decides)."""
        from leto_run.nvml import Nvml, NvmlError
        try:
            if self._nvml is None:
                self._nvml = Nvml.open() or False
            if not self._nvml:
                return False, "no NVML to see the device's memory"
            for dev in range(self._nvml.count()):
                held = self._nvml.process_bytes(dev).get(pid)
                if held is not None:
                    return room_beside_the_dead(self._nvml.memory(dev)[1], held)
        except NvmlError as e:
            return False, f"NVML: {e}"
        return True, "the dead process holds no device memory any more"

    def drain(self) -> list[tuple[int, int, float, str]]:
        """(pid, exitcode, mono, kind) of every notice posted since the last call: "began" (the
        exit began) or "drained" (its device work is proven done: `_await_drain`)."""
        out = []
        while True:
            try:
                data = os.read(self._r, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            for line in data.decode().splitlines():
                pid, status, mono, kind, token = line.split()
                if self._tokens.get(int(pid)) == int(token):    # else: a reused pid's predecessor
                    out.append((int(pid), int(status), float(mono), kind))
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
