"""The fork server as a fork of the agent: one `import torch` per job instead of two.

Why: the agent imports torch anyway (rendezvous, TCPStore); a fork server started by exec
imports it again -- seconds of CPU per job, and seconds of start-up, since that import begins
only after the agent's (docs/BENCHMARKS.md, the test suite's CPU).  Forked right after the
agent's imports, the server has torch already.

A fork of the agent is the process an exec'd server would be only when the agent's own process
is one: a ``python -u`` interpreter with no other interpreter option (so `sys.flags` are a
worker's), whose command-line area has room for a worker's command line (a worker writes its
own over it, `server._retitle`), and whose exec-time environment carries the job token (a forked
process's /proc/PID/environ is the block its ancestor was exec'd with, and the guardian and the
stop find escaped descendants by the token there).  So `leto-run` re-executes itself once at
its start (`reexec`, from `leto_run.entry`): the same interpreter and entry with ``-u`` first, the token and
`LETO_AGENT_EXEC` (equal to it) in the environment, `TITLE_ROOM` empty arguments at the end.
The re-executed agent takes the marker out of its environment (`take_token`), strips the
padding before click parses (`strip_padding`) and writes its original command line over its
own (``ps`` shows what the user typed).

Where that does not hold (a call in-process, interpreter options, ``PYTHON_EXEC``, a
``--nproc-per-node`` that needs torch to resolve -- the OMP rule must come before the import --,
the fork server off), the refusal says why and the agent starts an exec'd server as before.

The fork (`fork_server`) happens in `leto_run.cli` after the agent's imports and before
`Agent()`: no thread, handler, descriptor, exit function or log of the agent exists yet.  The
child becomes what `procs.spawn` and the interpreter's start would have made it (own process
group, parent-death signal, stdin on /dev/null, every other descriptor but 1, 2 and the socket
closed, the interpreter's signal handlers, a fresh interpreter's sys.path), forgets the agent's
own modules, and runs `server.main`.

Calling contract: `take_token()` and `strip_padding()` first in the console entry
(`leto_run.entry`); `reexec(...)` (does not return unless the exec fails) there, before the
CLI's imports, or once the config is built where the entry could not tell; `fork_server(...)`
in the agent's process only.  In the
child `fork_server` never returns: a worker's exit is a SystemExit that must reach the
interpreter's top level (nothing between here and it may catch it); the server's own end is
`os._exit`.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import traceback
from typing import MutableMapping, Sequence

from leto_run.fork_server.server import TITLE_ROOM
from leto_runtime.wire import contract as C

_PR_SET_PDEATHSIG = 1
_KEEP_MODULES = ("leto_run", "leto_run.fork_server", "leto_run.fork_server.server",
                 "leto_run.fork_server.wire", "leto_run.fork_server.child")


def take_token(environ: MutableMapping[str, str]) -> tuple[str | None, bool]:
    """(the job token this process was re-executed with, or None; whether a marker was there
    at all).  The marker leaves `environ` (os.environ), so no child of the agent inherits it.
    A process that found a marker never re-executes itself again, whatever it held: no exec
    loop, even from a stale or hand-set one (the server is then exec'd)."""
    mark = environ.pop(C.LETO_AGENT_EXEC, None)
    token = mark if mark and environ.get(C.LETO_JOB_TOKEN) == mark else None
    return token, mark is not None


def strip_padding(argv: list[str]) -> bool:
    """Drop the re-execution's padding from `argv` (sys.argv) in place; True when there was."""
    if len(argv) < TITLE_ROOM + 1 or any(argv[-TITLE_ROOM:]):
        return False
    del argv[-TITLE_ROOM:]
    return True


def refusal(orig_argv: Sequence[str], executable: str, workers_python: str,
            nproc_per_node: str) -> str | None:
    """Why the fork server cannot be a fork of this agent (None: it can).  `orig_argv`:
    the interpreter's command line as given (`sys.orig_argv`, re-execution's additions
    removed)."""
    why = python_refusal(executable, workers_python)
    if why is not None:
        return why
    if not nproc_per_node.isdigit():
        return (f"--nproc-per-node {nproc_per_node} resolves through torch, before the "
                "OMP_NUM_THREADS rule")
    return interpreter_options(orig_argv)


def python_refusal(executable: str, workers_python: str) -> str | None:
    """Why workers running `workers_python` cannot be forks of this interpreter (None: they
    can)."""
    if not executable or workers_python != executable:
        return f"the workers run {workers_python!r}, not this interpreter (PYTHON_EXEC)"
    return None


def interpreter_options(orig_argv: Sequence[str]) -> str | None:
    """Why `orig_argv` is not a plain ``python [-u] <leto-run script>`` or ``python [-u] -m
    leto_run`` (None: it is)."""
    rest = list(orig_argv[2:]) if orig_argv[1:2] == ["-u"] else list(orig_argv[1:])
    if rest[:2] == ["-m", "leto_run"] or (rest and not rest[0].startswith("-")):
        return None
    return f"leto-run was started with interpreter options ({' '.join(orig_argv[1:3])})"


def original_argv(orig_argv: Sequence[str], reexecuted: bool) -> list[str]:
    """The command line the user typed: `orig_argv` without the re-execution's additions."""
    if not reexecuted:
        return list(orig_argv)
    return [orig_argv[0], *orig_argv[2:len(orig_argv) - TITLE_ROOM]]


def reexec_argv(orig_argv: Sequence[str], executable: str) -> list[str]:
    return [executable, "-u", *orig_argv[1:], *[""] * TITLE_ROOM]


def reexec(job_token: str) -> None:
    """Replace this process by itself with ``-u``, the token and the padding (same pid,
    descriptors, signal dispositions).  Returns only when the exec fails."""
    env = dict(os.environ, **{C.LETO_JOB_TOKEN: job_token, C.LETO_AGENT_EXEC: job_token})
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, reexec_argv(sys.orig_argv, sys.executable), env)
    except OSError:
        return


def retitle(argv: Sequence[str]) -> None:
    """Show `argv` as this process's command line (best effort)."""
    from leto_run.fork_server.server import _retitle
    try:
        _retitle(list(argv))
    except (OSError, ValueError):
        pass


def fork_server(python: str, env: dict[str, str], also: tuple[str, ...]):
    """Fork the fork server from this process (it imports `also`, as `server.main`); the agent
    gets a `client.ForkServer`."""
    from leto_run import procs
    from leto_run.fork_server.client import ForkServer
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    agent = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        _child(mine, theirs, agent, env, also)      # raises SystemExit or exits
    theirs.close()
    try:
        return ForkServer(python, env, procs.adopt(pid), mine, how="inherit")
    except BaseException:
        mine.close()
        raise


def _child(mine: socket.socket, theirs: socket.socket, agent: int, env: dict[str, str],
           also: tuple[str, ...]):
    try:
        mine.close()
        fd = _become_server_process(theirs, agent, env)
        from leto_run.fork_server import server
        retitle(["leto_run.fork_server", f"(forked from the leto-run agent {agent})"])
        server.main(fd, also)
    except SystemExit:
        raise                       # a worker's exit: the interpreter's, at its top level
    except BaseException:           # noqa: BLE001 -- never return into the agent's frames
        try:
            from leto_run.fork_server.server import say
            say("[leto-run fork-server] " + traceback.format_exc())
        finally:
            os._exit(1)
    os._exit(0)                     # the server's end: nothing of the agent may run here


def _become_server_process(sock: socket.socket, agent: int, env: dict[str, str]) -> int:
    """What `procs.spawn` and the interpreter's start give an exec'd server."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != agent:
        os._exit(137)
    os.setpgid(0, 0)
    from leto_run.procs import RESET_SIGNALS, close_fds_except
    for s in RESET_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    # the interpreter's own start-up dispositions
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    fd = sock.detach()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    close_fds_except({0, 1, 2, fd})
    if not sys.flags.safe_path and sys.path:
        del sys.path[0]             # the agent's entry's directory: a worker gets its own
    for name in [m for m in sys.modules
                 if m.startswith(("leto_run.", "leto_runtime")) and m not in _KEEP_MODULES]:
        del sys.modules[name]
    os.environ.clear()
    os.environ.update(env)
    return fd
