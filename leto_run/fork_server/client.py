"""The agent's side of the fork server: start it, send it workers, fall back to a plain spawn.

`Launcher.spawn` has `procs.spawn`'s contract (a `Proc` watched by pidfd, in its own process
group, with a parent-death signal, descriptors passed at their numbers) plus `Proc.release()`,
which the caller calls once it has recorded the worker.  A request goes to the fork server
unless `refusal` names a reason; a server that fails (does not start, dies, times out) is
stopped and every later worker is spawned plainly -- the reason is logged once and recorded
as a ``fork_server`` event.  The server is off with ``LETO_FORK_SERVER=0``.

Calling contract: the agent's main thread only (as `procs.spawn`), after `become_subreaper()`;
`close()` at the end (the server exits at the socket's EOF, and is killed if it does not).
"""
from __future__ import annotations

import os
import resource
import signal
import socket
import time
from typing import Callable, Mapping

from leto_run import procs
from leto_run.fork_server import wire
from leto_run.fork_server.server import ALSO_PRELOAD, BOOT, TITLE_ROOM
from leto_run.worker_env import per_worker

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY_S = 120.0         # the server's `import torch` (a cold file system can take a minute)
REPLY_S = 30.0          # one fork: milliseconds, seconds on a swapping machine
STOP_S = 5.0


def refusal(server_env: Mapping[str, str], python: str, argv: list[str],
            env: Mapping[str, str]) -> str | None:
    """Why a worker with `argv` and `env` cannot come from a fork server started as
    ``python -u`` with `server_env` (None: it can): its interpreter or flags differ, or a
    variable that is not per-worker differs (something may read it at import)."""
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return (f"the workers run {' '.join(argv[:2])!r}, not this interpreter with -u "
                "(PYTHON_EXEC or --no-python)")
    keys = sorted(k for k in set(env) | set(server_env)
                  if not per_worker(k) and env.get(k) != server_env.get(k))
    if keys:
        return f"the workers' environment differs from the fork server's in {', '.join(keys[:5])}"
    return None


def process_attrs() -> dict:
    """What an exec'd child of this process would inherit now and a fork of the server, started
    earlier, might not have: resource limits (the agent raises its RLIMIT_NOFILE after the
    server started), umask, CPU affinity, nice value (a `renice` or `taskset` of the agent)."""
    umask = None
    with open("/proc/self/status") as f:        # read, not set-and-restore: other threads
        for line in f:
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
    return {"rlimits": {name: list(resource.getrlimit(getattr(resource, name)))
                        for name in dir(resource) if name.startswith("RLIMIT_")},
            "umask": umask, "affinity": sorted(os.sched_getaffinity(0)),
            "nice": os.getpriority(os.PRIO_PROCESS, 0)}


class ForkServerDown(RuntimeError):
    pass


class ForkServer:
    """A running fork server: `proc` (our child), `sock` (our end), `env` (what it imported
    torch under, for `refusal`), `python` (its interpreter), `how` (exec'd, or forked from
    the agent: `inherit`)."""

    def __init__(self, python: str, env: dict[str, str], proc: procs.Proc, sock: socket.socket,
                 how: str = "exec"):
        self.python, self.env, self.proc, self.sock, self.how = python, env, proc, sock, how
        self.ready = False

    @classmethod
    def spawned(cls, python: str, env: dict[str, str],
                also: tuple[str, ...] = ALSO_PRELOAD) -> "ForkServer":
        """A server exec'd as ``python -u -c BOOT`` with `env`: it imports torch itself, then
        `also`."""
        sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = procs.spawn([python, "-u", "-c", BOOT, str(theirs.fileno()), _ROOT,
                                ",".join(also), *[""] * TITLE_ROOM], env, pass_fds=(theirs.fileno(),))
        except BaseException:
            sock.close()
            raise
        finally:
            theirs.close()
        return cls(python, env, proc, sock)

    def _wait_ready(self) -> None:
        self.sock.settimeout(READY_S)
        msg = self._recv("did not say ready")
        if msg.get("problem") or msg.get("ready") != self.proc.pid:
            raise ForkServerDown(msg.get("problem") or f"a wrong ready message: {msg}")
        self.ready = True

    def _recv(self, what: str) -> dict:
        try:
            got = wire.recv(self.sock)
        except (OSError, ValueError) as e:
            raise ForkServerDown(f"{what}: {type(e).__name__}: {e}") from None
        if got is None:
            raise ForkServerDown(f"{what}: it exited ({self._exit()})")
        msg, fds = got
        for fd in fds:
            os.close(fd)
        return msg

    def _exit(self) -> str:
        try:
            code = self.proc.popen.wait(timeout=1.0)
        except Exception:                           # noqa: BLE001
            return "still running"
        self.proc.poll_exit()
        return procs.ExitStatus(code, 0.0).describe()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int,
              pass_fds: tuple[int, ...]) -> procs.Proc:
        if not self.ready:
            self._wait_ready()
        started = time.monotonic()
        gate_r, gate_w = os.pipe()
        try:
            self.sock.settimeout(REPLY_S)
            req = {"argv": argv, "env": dict(env), "cwd": os.getcwd(),
                   "targets": list(pass_fds), "attrs": process_attrs()}
            try:
                wire.send(self.sock, req, (stdout, stderr, *pass_fds, gate_r))
            except (OSError, ValueError) as e:
                raise ForkServerDown(f"a request failed: {type(e).__name__}: {e}") from None
            msg = self._recv("did not answer a request")
        except BaseException:
            os.close(gate_w)
            raise
        finally:
            os.close(gate_r)
        if "pid" not in msg:
            os.close(gate_w)
            raise ForkServerDown(msg.get("error") or f"a wrong reply: {msg}")
        try:
            proc = procs.adopt(int(msg["pid"]), gate_fd=gate_w)
            proc.started_mono = started
            return proc
        except BaseException:
            os.close(gate_w)
            raise

    def kill(self) -> None:
        """Stop it at once (the agent did not start: nothing was forked from it yet)."""
        self.proc.send(signal.SIGKILL)
        self.close()

    def close(self) -> None:
        self.sock.close()
        if self.proc.poll_exit() is None:
            try:
                self.proc.popen.wait(timeout=STOP_S)
            except Exception:                       # noqa: BLE001
                self.proc.send(signal.SIGKILL)
                self.proc.popen.wait(timeout=STOP_S)
            self.proc.poll_exit()


class Launcher:
    """Spawns workers through the fork server when it can, else with `procs.spawn`."""

    def __init__(self, enabled: bool, python: str, env: dict[str, str],
                 log: Callable[[str], None], emit: Callable[..., None],
                 forked: ForkServer | None = None, note: str | None = None,
                 preload=None):
        """`forked`: a server already forked from the agent (`inherit.fork_server`); `note`:
        why it is not (recorded in the server's spawn event); `preload`: what the server
        imports after torch (a `preload.Plan`; None: all of ALSO_PRELOAD)."""
        self.log, self.emit = log, emit
        self.server: ForkServer | None = forked
        self.fell_back: str | None = None if enabled else "off (LETO_FORK_SERVER=0, --no-python)"
        if enabled and forked is None:
            try:
                self.server = ForkServer.spawned(
                    python, env, ALSO_PRELOAD if preload is None else preload.modules)
            except OSError as e:
                self._down(f"it did not start: {e}")
        if self.server is not None:
            self.emit("spawn", 0, role="fork_server", pid=self.server.proc.pid,
                      how=self.server.how, **({"exec_because": note} if note else {}),
                      **({"preload": list(preload.modules), "preload_because": preload.reason}
                         if preload is not None else {}))

    def pids(self) -> set[int]:
        s = self.server
        return {s.proc.pid} if s is not None and s.proc.status is None else set()

    def _down(self, why: str) -> None:
        self.log(f"fork server: {why}; workers are spawned plainly from now on")
        self.emit("fork_server", 0, state="down", reason=why)
        if self.server is not None:
            self.server.close()
        self.server, self.fell_back = None, why

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int,
              pass_fds: tuple[int, ...] = ()) -> procs.Proc:
        s = self.server
        why = refusal(s.env, s.python, argv, env) if s is not None else self.fell_back
        if s is not None and why is None:
            try:
                return s.spawn(argv, env, stdout, stderr, pass_fds)
            except ForkServerDown as e:
                self._down(str(e))
        elif s is not None:
            self._down(why)
        return procs.spawn(argv, env, stdout=stdout, stderr=stderr, pass_fds=pass_fds)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
