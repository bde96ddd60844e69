"""The guardian: a tiny forked process that cleans up if the agent is killed with SIGKILL.

A `kill -9` of `leto-run` runs no Python code in the agent.  Workers die of their parent-death
signal, but their grandchildren are not covered by it.  The guardian is forked before anything
else starts (no threads, no torch), reads the agent's announcements over a pipe, and when the
pipe reaches EOF without a final ``done`` line, it SIGKILLs every announced process group and
every process that carries this job's token in its environment, then exits.

Contract: `start_guardian(token)` -> `Guardian`; call `.announce(pgid)` for each spawned process
group and `.release()` after a clean shutdown (the guardian then exits without killing).
"""
from __future__ import annotations

import os
import signal

from leto_run.procs import kill_pids, pids_with_token


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
        # Hold no end of the agent's stdout/stderr pipes: whoever reads them waits for EOF.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.setsid()  # leave the agent's group so a killpg aimed at it does not hit us
        pgids: list[int] = []
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
                elif word == "done":
                    clean = True
        if not clean:
            for g in pgids:
                try:
                    os.killpg(g, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            kill_pids(pids_with_token(token_kv))
    finally:
        os._exit(0)
