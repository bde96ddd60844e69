"""Process mechanics behind a small interface: spawn, watch, signal, stop, reap.

The control loop (`leto_run.agent`) never touches pids directly; it holds `Proc` objects and
asks this module to start and stop them.  Why each mechanism is here (docs/ARCHITECTURE.md,
"The process tree"):

- every child gets its own process group (``process_group=0``) so a signal reaches the
  worker *and* its grandchildren, and a parent-death signal so a ``kill -9`` of the agent does
  not leave it running;
- each child is watched through a pidfd: it becomes readable within ~1 ms of the exit, which
  the agent's selector sees without sleep-polling;
- signals go through ``pidfd_send_signal`` (no pid-reuse race) or ``killpg`` on the recorded
  group; the agent is a child subreaper so orphaned descendants come back to it and are
  killed and reaped too.

Contract: `spawn` must be called from the agent's main thread (PDEATHSIG fires when the
*thread* that forked exits).  `Proc.poll_exit` is the only place a child is reaped.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import psutil

from leto_runtime.wire.open_files import fds_under

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> bool:
    """Make this process the reaper of orphaned descendants (Linux >= 3.4)."""
    return _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


# The agent blocks/ignores some signals for its own loop; every worker starts with these at
# their defaults (the fork server's workers too: the server is spawned this way).
RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                 signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGPIPE)


def _child_setup(parent_pid: int):
    # Runs in the child between fork and exec.  The re-check of getppid closes the race where
    # the parent died before prctl took effect.
    def setup():
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(137)
        for s in RESET_SIGNALS:         # children start clean
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])

    return setup


@dataclass
class ExitStatus:
    """How a process ended: exactly one of `exitcode` (>= 0) / `signal` is meaningful."""

    exitcode: int            # torch convention: negative => killed by signal -exitcode
    mono: float              # monotonic time the exit was observed

    @property
    def signal(self) -> int | None:
        return -self.exitcode if self.exitcode < 0 else None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                return f"Signal {self.signal} ({signal.Signals(self.signal).name})"
            except ValueError:
                return f"Signal {self.signal}"
        return f"exit code {self.exitcode}"


@dataclass
class Proc:
    """One child process the agent started."""

    popen: "subprocess.Popen | Adopted"
    pidfd: int
    started_mono: float
    status: ExitStatus | None = None
    descendants_seen: set[int] = field(default_factory=set)
    # Its exit began and none of its threads runs user code any more (`leto_run.exit_notice`):
    # nothing waits for its reap, which still comes through the pidfd.
    stopped: bool = False
    # GPU machines: the read end of its exit fence while watched, and what it said ("quiet":
    # its device work stopped; "untrusted"): `leto_run.exit_notice`.
    fence_fd: int | None = None
    fence: str | None = None
    # ... or, sooner, its drain words proved its queued device work done (leto_runtime/drain.py)
    drained: bool = False
    # A forked worker (`leto_run.fork_server`) waits for this pipe's EOF before its user code
    # runs: `release()` once the agent has recorded it.
    gate_fd: int | None = None

    def release(self) -> None:
        if self.gate_fd is not None:
            os.close(self.gate_fd)
            self.gate_fd = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.status is None

    @property
    def quiet(self) -> bool:
        """Nothing of it can write retained memory any more: while its exit fence is watched
        or said so, the fence decides (it waits for every process holding its device files,
        forked children too); else its reap, or -- without a GPU -- its exit notice."""
        if self.drained:
            return True
        if self.fence_fd is not None or self.fence == "quiet":
            return self.fence == "quiet"
        return self.status is not None or self.stopped

    def poll_exit(self) -> ExitStatus | None:
        """Reap the child if it exited (non-blocking).  Safe to call repeatedly."""
        if self.status is not None:
            return self.status
        code = self.popen.poll()
        if code is None:
            return None
        self.status = ExitStatus(code, time.monotonic())
        try:
            os.close(self.pidfd)
        except OSError:
            pass
        self.pidfd = -1
        return self.status

    def send(self, sig: int) -> bool:
        """Signal the process itself (not its group); False if it is already gone."""
        if self.status is not None or self.pidfd < 0:
            return False
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
            return True
        except ProcessLookupError:
            return False

    def send_group(self, sig: int) -> None:
        """Signal the process group (worker and the grandchildren it did not detach)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def snapshot_descendants(self) -> set[int]:
        """Remember current descendants: after the worker dies they are no longer findable
        through it (they reparent to us, the subreaper), so collect them while we can."""
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
            self.descendants_seen |= {k.pid for k in kids}
        except psutil.Error:
            pass
        return self.descendants_seen


def spawn(argv: list[str], env: dict[str, str], cwd: str | None = None,
          stdout=None, stderr=None, pass_fds: tuple[int, ...] = ()) -> Proc:
    """Start `argv` in its own process group with a parent-death signal; watch it by pidfd."""
    popen = subprocess.Popen(
        argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        process_group=0, preexec_fn=_child_setup(os.getpid()), close_fds=True,
        pass_fds=pass_fds,
    )
    pidfd = os.pidfd_open(popen.pid)
    return Proc(popen=popen, pidfd=pidfd, started_mono=time.monotonic())


class Adopted:
    """Popen's view (pid, returncode, poll, wait) of a child this process did not fork: a
    worker forked by the fork server and orphaned to us, the subreaper."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:       # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
            time.sleep(0.005)
        return self.returncode


def adopt(pid: int, gate_fd: int | None = None) -> Proc:
    """Watch `pid`, already our child (adopted), as `spawn` watches what it starts."""
    return Proc(popen=Adopted(pid), pidfd=os.pidfd_open(pid), started_mono=time.monotonic(),
                gate_fd=gate_fd)


def close_fds_except(keep: set[int]) -> None:
    """Close every descriptor of this process but `keep`: a process forked from the agent
    (the guardian, the fork server) must hold no end of the agent's pipes and sockets, or
    whoever waits for their EOF waits for it instead."""
    for name in os.listdir("/proc/self/fd"):     # a snapshot: its own descriptor is gone
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass


def stat_fields(path: str) -> list[bytes] | None:
    """The fields of a /proc/PID[/task/TID]/stat from field 3 (state) on; None when it
    cannot be read (the process is gone).  The name in field 2 may hold spaces and ')'."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def reap_orphans(known: set[int]) -> list[int]:
    """Reap exited children that are not ours to reap elsewhere (reparented orphans).

    Uses WNOWAIT to peek first so a managed child's status is left for `Proc.poll_exit`.
    """
    reaped = []
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            break
        if info is None or info.si_pid == 0 or info.si_pid in known:
            break
        try:
            os.waitpid(info.si_pid, 0)
            reaped.append(info.si_pid)
        except ChildProcessError:
            break
    return reaped


def device_strays(known: set[int], prefix: str) -> list[int]:
    """Children of this process that it did not start -- orphans reparented to it, the
    subreaper -- holding a file under `prefix` (a GPU's device files): after a trainer's reap,
    what may still run its GPU work (a forked child keeps the context's files open)."""
    try:
        kids = psutil.Process().children()
    except psutil.Error:
        return []
    return [k.pid for k in kids if k.pid not in known and fds_under(prefix, k.pid)]


def exited(pid: int) -> bool:
    """`pid`, a child of this process, has exited (a zombie: its files are released) or is
    gone (reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def paused(pid: int) -> bool:
    """`pid` is stopped (SIGSTOP, SIGTSTP) or held by a debugger: it runs no code until
    continued, so it serves nothing and dumps no stacks."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return bool(fields) and fields[0] in (b"T", b"t")


def kill_pids(pids, sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def pids_with_token(key_value: str) -> list[int]:
    """Processes of this user whose environment carries the job token (escaped descendants).

    Why: a descendant that called setsid() left every process group we know; the token it
    inherited in its environment still names it as ours.
    """
    needle = b"\0" + key_value.encode() + b"\0"
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                data = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        if needle in data:
            found.append(int(entry.name))
    return found
