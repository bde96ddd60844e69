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
import shutil
import signal
import time

from leto_run.procs import close_fds_except, kill_pids, pids_with_token

# How long the guardian waits for the processes it killed to be gone before it removes the
# directories (a dying process could still create a socket file in one).
KILL_WAIT_S = 5.0


class Guardian:
    def __init__(self, pid: int, wfd: int):
        self.pid, self._wfd = pid, wfd

    def _say(self, line: str) -> None:
        if self._wfd < 0:
            return
        try:
            os.write(self._wfd, (line + "\n").encode())
        except OSError:
            pass

    def announce(self, pgid: int) -> None:
        self._say(f"pgid {pgid}")

    def own_dir(self, path: str) -> None:
        """Remove `path` (recursively) if the agent dies without `release()`."""
        # hex: any byte of a path (spaces, newlines) survives the line protocol
        self._say(f"dir {os.fsencode(os.path.abspath(path)).hex()}")

    def release(self) -> None:
        """Clean shutdown: the guardian exits without killing anything."""
        self._say("done")
        if self._wfd >= 0:
            os.close(self._wfd)
            self._wfd = -1
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
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
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(rfd)
        os.set_inheritable(wfd, False)
        return Guardian(pid, wfd)
    # ---- child: the guardian -----------------------------------------------------------
    try:
        os.close(wfd)
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
    finally:
        os._exit(0)
