"""The guardian: a tiny forked process that cleans up if the agent is killed with SIGKILL.

A `kill -9` of `leto-run` runs no Python code in the agent.  Workers die of their parent-death
signal, but their grandchildren are not covered by it, and the agent's run directory (sockets,
allow files; 0700) stays in $TMPDIR.  The guardian is forked before anything else starts (no
threads, no torch), reads the agent's announcements over a pipe, and when the pipe reaches EOF
without a final ``done`` line, it SIGKILLs every announced process group and every process that
carries this job's token in its environment, waits (bounded) until they are gone, removes every
directory it was given, then exits.

Contract: `start_guardian(token)` -> `Guardian`; call `.announce(pgid)` for each spawned process
group, `.own_dir(path)` for each directory to remove after a kill of the agent (the agent's run
directory, right after creating it), and `.release()` after a clean shutdown (the guardian then
exits without killing or removing anything: the agent cleans up itself).
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import time

from leto_run.procs import close_fds_except, kill_pids, pids_with_token

# How long the guardian waits for the processes it killed to be gone before it removes the
# directories (a dying process could still create a socket file in one).
KILL_WAIT_S = 5.0
# A guardian that dies more than this often within the window is not started again.
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0


class Guardian:
    """The agent's handle on its guardian: what it says goes down the pipe, and is remembered,
    so that a guardian that died is replaced by one that knows as much (`replace`)."""

    def __init__(self, pid: int, wfd: int, token_kv: str):
        self.pid, self._wfd, self._token_kv = pid, wfd, token_kv
        self.pidfd = os.pidfd_open(pid)        # the agent's selector sees its death
        self._said: list[bytes] = []           # every `pgid` and `dir` line, to tell a new one
        self._out = b""                        # not yet taken by the pipe (a stopped guardian)
        self.deaths: list[float] = []          # monotonic times of its deaths (guardian_verdict)

    def _say(self, line: str) -> None:
        data = (line + "\n").encode()
        if line != "done":
            self._said.append(data)
        self._out += data
        self._flush()

    def _flush(self) -> None:
        """Non-blocking: a guardian that does not read (stopped) must not block the agent;
        what its pipe cannot take now waits for the next line."""
        while self._out and self._wfd >= 0:
            try:
                n = os.write(self._wfd, self._out)
            except BlockingIOError:
                return
            except OSError:              # it is gone: `replace` tells the next one everything
                self._out = b""
                return
            self._out = self._out[n:]

    def announce(self, pgid: int) -> None:
        self._say(f"pgid {pgid}")

    def own_dir(self, path: str) -> None:
        """Remove `path` (recursively) if the agent dies without `release()`."""
        # hex: any byte of a path (spaces, newlines) survives the line protocol
        self._say(f"dir {os.fsencode(os.path.abspath(path)).hex()}")

    def reap(self) -> str | None:
        """Its pidfd fired: reap it; how it ended, or None if it still runs."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return "gone (reaped elsewhere)"
        if pid == 0:
            return None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return (f"killed by {signal.Signals(sig).name}" if sig else
                f"exit code {os.waitstatus_to_exitcode(status)}")

    def replace(self, now: float) -> tuple[bool, str]:
        """After `reap`: a new guardian, told every directory and process group the old one was
        (`decisions.guardian_verdict` bounds how often); (started, why)."""
        from leto_run.decisions import guardian_verdict
        self._close()
        ok, why = guardian_verdict(self.deaths, now, MAX_RESTARTS, RESTART_WINDOW_S)
        self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW_S] + [now]
        self.pid = 0                         # none runs until one is started
        if not ok:
            return False, why
        try:
            pid, wfd = _fork_guardian(self._token_kv)
        except OSError as e:                 # no process or fd left for it: say so, go on
            return False, (f"it cannot be started again ({type(e).__name__}: {e}): if the "
                           "agent is killed now (kill -9), nothing stops its processes or "
                           "removes its run directory")
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError as e:
            os.kill(pid, signal.SIGKILL)     # first: its pipe's EOF alone would make it clean up
            os.waitpid(pid, 0)
            os.close(wfd)
            return False, f"it cannot be watched ({type(e).__name__}: {e}); none runs"
        self.pid, self._wfd = pid, wfd
        self._out = b"".join(self._said)
        self._flush()
        return True, why

    def _close(self) -> None:
        for fd in (self._wfd, self.pidfd):
            if fd >= 0:
                os.close(fd)
        self._wfd = self.pidfd = -1
        self._out = b""

    def release(self) -> None:
        """Clean shutdown: the guardian exits without killing anything.  Bounded: one that does
        not take `done` and exit (stopped) is killed instead -- the agent cleans up itself."""
        if self.pidfd < 0:
            return                          # none runs (`replace` gave up)
        self._say("done")
        if self._out:                       # not read: an EOF without `done` means clean up
            self._kill()
        os.close(self._wfd)                 # `done`, then EOF: it exits
        self._wfd = -1
        if not select.select([self.pidfd], [], [], KILL_WAIT_S)[0]:
            self._kill()
        self._close()
        try:
            os.waitpid(self.pid, 0)         # exited, or SIGKILLed just now
        except ChildProcessError:
            pass

    def _kill(self) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _clean_up(pgids: list[int], dirs: list[str], token_kv: str) -> None:
    for g in pgids:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    victims = set(pids_with_token(token_kv))
    kill_pids(victims)
    victims |= set(pgids)          # a group's leader pid is the group id
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and any(_alive(p) for p in victims):
        time.sleep(0.02)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _retitle(agent: int) -> None:
    """`ps` and `pkill -f` tell the guardian from the agent it was forked from (best effort:
    the agent's command-line area may be too short for the whole title)."""
    from leto_run.fork_server.inherit import retitle
    retitle(["leto_run.guardian", f"(of the leto-run agent {agent})"])


def start_guardian(token_kv: str) -> Guardian:
    """Fork the guardian.  Call before any thread exists (fork safety)."""
    return Guardian(*_fork_guardian(token_kv), token_kv)


def _fork_guardian(token_kv: str) -> tuple[int, int]:
    """(pid, write end of its pipe).  Also the agent's replacement of a dead guardian, when its
    threads run: the child then only makes system calls and takes no lock another thread may
    hold (no logging, no output, `os._exit`)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(rfd)
        os.set_inheritable(wfd, False)
        os.set_blocking(wfd, False)
        return pid, wfd
    try:
        os.close(wfd)
        _guard(rfd, token_kv)
    finally:
        os._exit(0)


def _guard(rfd: int, token_kv: str) -> None:
    """The guardian process: read the agent's lines until EOF; clean up unless told `done`."""
    # Ctrl-C / SIGHUP to the terminal's group reach us too: those are for the agent.
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT,
              signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)
    # Hold no end of the agent's pipes and sockets (stdout/stderr, the fork server's
    # socket): whoever reads them waits for EOF.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    close_fds_except({0, 1, 2, rfd})
    os.setsid()  # leave the agent's group so a killpg aimed at it does not hit us
    _retitle(os.getppid())
    pgids: list[int] = []
    dirs: list[str] = []
    buf = b""
    clean = False
    while True:
        chunk = os.read(rfd, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            word, _, arg = line.decode(errors="replace").partition(" ")
            if word == "pgid" and arg.isdigit():
                pgids.append(int(arg))
            elif word == "dir":
                try:
                    dirs.append(os.fsdecode(bytes.fromhex(arg)))
                except ValueError:
                    pass
            elif word == "done":
                clean = True
    if not clean:
        _clean_up(pgids, dirs, token_kv)
