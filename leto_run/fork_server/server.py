"""The fork server process: import torch once, then fork one worker per request of the agent.

What it imports: `PRELOAD` (torch; the server is refused without it), then, best effort, the
part of `ALSO_PRELOAD` the job's script will use (`leto_run.fork_server.preload`): what a
trainer would otherwise import after torch and pay again in each process (torch._dynamo, which
torch.optim's optimizers import at construction; DCP, which the runtime's checkpoint paths use).  Neither reads a per-worker variable at import, nor queries a device
(the agent refuses the server where the workers' shared environment differs from its own).

Runs as ``python -u -c BOOT <fd> <root> <padding>``, started by the agent through `procs.spawn` (own process
group, parent-death signal, the environment every worker shares).  It says ``ready`` once the
preload is imported, then serves requests one at a time until the agent closes the socket.

A request is ``{"argv", "env", "cwd", "targets", "attrs"}`` with the descriptors [stdout, stderr,
*passed, gate]: the worker gets them at fds 1, 2 and `targets`; the gate is the read end of a
pipe the agent closes once it has recorded the worker (its pid watched, allowed by its state
manager, announced to the guardian), so no user code runs before that.  The reply is
``{"pid"}`` or ``{"error"}``.

Per request the server forks an intermediate, which forks the worker and exits at once: the
worker is orphaned to the agent, the child subreaper (the agent waits on it and reads its exit
status itself).  Only then does the worker set its parent-death signal (set earlier, the
intermediate's exit would fire it), checks its parent is the agent, and takes its own process
group, descriptors, process attributes (the agent's resource limits, umask, CPU affinity and nice
value at the request, as an exec'd worker inherits them), working directory and environment, in
that order, and arms its exit notice
(`leto_runtime.exit_notice.arm`, as a script's import of leto_runtime does).  A worker that cannot
set itself up says why on its stderr and exits 1 -- a failure of that worker, as if its
interpreter had failed to start.

Calling contract: `main(fd)` only, in a process of its own (it never returns in a worker: the
worker runs its command line through `child.run`, which ends in `sys.exit`).
"""
from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import socket
import sys
import time

from leto_run.fork_server import wire

# sys.argv: [fd, the agent's leto_run root, the preload after torch (comma-separated), padding].  The server's own modules come from the
# agent's tree (a checkout may shadow an install); the entry goes again before any worker, whose
# sys.path is then a fresh interpreter's (the cwd entry of -c is not the worker's either).
BOOT = ("import sys; sys.path[0] = sys.argv[2]; from leto_run.fork_server.server import main; "
        "del sys.path[0]; main(int(sys.argv[1]), tuple(filter(None, sys.argv[3].split(','))))")
# What every worker imports first, and nothing that reads a worker's own variables at import:
# `client.refusal` checks that the rest of a worker's environment equals the server's.
PRELOAD = ("torch",)
# What the agent may add for a job (`leto_run.fork_server.preload` decides from the script).
ALSO_PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint")
# Empty arguments after the server's own: NUL bytes of its command-line area, which a worker
# overwrites with its own command line (`ps`, `pkill -f` and /proc/PID/cmdline show the
# worker's, as for a spawned one; a longer one is cut at this size).
TITLE_ROOM = 16384
ADOPT_S = 10.0          # the intermediate's exit (it only forks and writes its child's pid)
GATE_S = 120.0          # the agent's bookkeeping after the reply (a busy machine's worst case)
_PR_SET_PDEATHSIG = 1


def say(text: str) -> None:
    """The server's own word on its stderr: the agent's console as it was at the fork, which
    may be gone since (a closed terminal, a reader that exited: the agent put /dev/null in its
    place, not in ours).  Nothing to do then but stay quiet."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _readable(fd: int, timeout: float) -> bool:
    poller = select.poll()          # (not select(): any descriptor number)
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def _preload(also: tuple[str, ...]) -> str | None:
    for name in PRELOAD:
        try:
            __import__(name)
        except BaseException as e:          # noqa: BLE001 -- any failure: the agent spawns plainly
            return f"import {name} failed: {type(e).__name__}: {e}"
    for name in also:
        try:
            __import__(name)
        except Exception:                   # noqa: BLE001 -- a worker that needs it imports it
            pass
    return None


def main(fd: int, also: tuple[str, ...] = ALSO_PRELOAD) -> None:
    """`also`: what to import after torch, best effort (a subset of ALSO_PRELOAD)."""
    sock = socket.socket(fileno=fd)
    agent = os.getppid()
    problem = _preload(also)
    # What the preload made is shared by every worker: frozen, no collection of any process
    # walks it again -- neither a worker's (copy-on-write faults on every page it touches) nor
    # its exit's (the interpreter's final collections over torch's objects; docs/BENCHMARKS.md,
    # the fork server).  What a worker makes itself is collected as in any interpreter.
    gc.freeze()
    try:
        wire.send(sock, {"ready": os.getpid(), "problem": problem,
                         "preloaded": [n for n in PRELOAD + also if n in sys.modules]})
    except OSError:
        return                      # the agent is gone or gave up on us: nothing to serve
    if problem:
        return
    while True:
        try:
            msg = wire.recv(sock)
        except (OSError, ValueError) as e:
            say(f"[leto-run fork-server] the agent's socket failed: {e}\n")
            return
        if msg is None:
            return                                  # the agent is done with us
        argv = _serve(sock, *msg, agent)
        if argv is not None:
            break
    from leto_run.fork_server import child          # the worker, from here on
    child.run(argv)


def _serve(sock: socket.socket, req: dict, fds: list[int], agent: int) -> list[str] | None:
    """Fork one worker for `req`.  Returns its argv in the worker, None in the server."""
    r, w = os.pipe()
    try:
        middle = os.fork()
    except OSError as e:
        for x in (r, w, *fds):
            os.close(x)
        wire.send(sock, {"error": f"fork failed: {e}"})
        return None
    if middle == 0:
        os.close(r)
        return _intermediate(sock, req, fds, agent, w)
    os.close(w)
    for x in fds:
        os.close(x)                 # the worker's alone now (an exit fence's EOF must be its)
    got = b""
    if _readable(r, ADOPT_S):
        got = os.read(r, 32)
    os.close(r)
    try:
        if got.isdigit():
            wire.send(sock, {"pid": int(got)})
        else:
            wire.send(sock, {"error": "the intermediate process failed to fork the worker"})
    finally:
        # after the reply: the intermediate exits right after its write (or without one), and
        # its exit -- unmapping its copy of the server -- is not the agent's to wait for
        os.waitpid(middle, 0)
    return None


def _intermediate(sock, req: dict, fds: list[int], agent: int, w: int) -> list[str]:
    middle = os.getpid()
    try:
        pid = os.fork()
    except BaseException:                           # noqa: BLE001
        os._exit(1)
    if pid == 0:
        os.close(w)
        try:
            return _become_worker(sock, req, fds, agent, middle)
        except BaseException as e:                  # noqa: BLE001 -- say why, then exit 1
            try:
                os.write(2, f"[leto-run fork-server] worker set-up failed: "
                            f"{type(e).__name__}: {e}\n".encode())
            finally:
                os._exit(1)
    try:
        os.write(w, str(pid).encode())
    finally:
        os._exit(0)


def _become_worker(sock, req: dict, fds: list[int], agent: int, middle: int) -> list[str]:
    deadline = time.monotonic() + ADOPT_S
    while os.getppid() == middle:
        if time.monotonic() > deadline:
            os._exit(137)
        time.sleep(0.0002)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != agent:
        os._exit(137)          # the agent is gone (or is no subreaper): nobody would watch us
    os.setpgid(0, 0)
    sock.close()
    *placed, gate = fds
    if not _readable(gate, GATE_S) or os.read(gate, 1) != b"":
        raise RuntimeError(f"the agent did not release the worker within {GATE_S:g} s")
    os.close(gate)
    _place(placed, [1, 2, *req["targets"]])
    for step, arg in ((_attrs, req.get("attrs", {})), (_retitle, req["argv"])):
        try:            # best effort: a worker that differs here still trains, and says so
            step(arg)
        except (OSError, ValueError) as e:
            sys.stderr.write(f"[leto-run fork-server] {step.__name__.strip('_')}: "
                             f"{type(e).__name__}: {e}\n")
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    # A fresh interpreter seeds numpy's global generator anew: reseed the one inherited from
    # the server, if the server made it (numpy 2 imports numpy.random on first use; importing
    # it here would cost every worker the import, for a generator it then makes fresh anyway).
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    _arm_notice()
    return list(req["argv"][2:])


def _arm_notice() -> None:
    """Every worker's abrupt death is seen as its exit begins, not only a script's that imports
    leto_runtime (whose import arms the notice the same way: leto_runtime/exit_notice.py).
    Imported as the script would import it; where it cannot be (the agent runs from a tree the
    worker's sys.path does not hold), the reap tells, as for an exec'd script."""
    try:
        from leto_runtime import exit_notice
    except ImportError:
        return
    try:
        exit_notice.arm()
    except Exception as e:                          # noqa: BLE001 -- the worker runs on
        sys.stderr.write(f"[leto-run fork-server] exit notice not armed: {type(e).__name__}: "
                         f"{e}\n")


def _attrs(attrs: dict) -> None:
    """The agent's process attributes at the request (`client.process_attrs`: an exec'd
    worker inherits them; the server has the agent's at its own start)."""
    import resource
    for name, (soft, hard) in attrs.get("rlimits", {}).items():
        res = getattr(resource, name, None)
        if res is not None and resource.getrlimit(res) != (soft, hard):
            resource.setrlimit(res, (soft, hard))
    if attrs.get("umask") is not None:
        os.umask(attrs["umask"])
    if attrs.get("affinity") and sorted(os.sched_getaffinity(0)) != attrs["affinity"]:
        os.sched_setaffinity(0, attrs["affinity"])
    if attrs.get("nice") is not None and os.getpriority(os.PRIO_PROCESS, 0) != attrs["nice"]:
        os.setpriority(os.PRIO_PROCESS, 0, attrs["nice"])


def _retitle(argv: list[str]) -> None:
    """Write `argv` over this process's command-line area (arg_start..arg_end of
    /proc/self/stat, fields 48-49): NUL-separated, NUL-padded, cut to fit."""
    with open("/proc/self/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rfind(b")") + 2:].split()
    start, end = int(fields[45]), int(fields[46])
    text = b"\0".join(os.fsencode(a) for a in argv)[:end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _place(fds: list[int], targets: list[int]) -> None:
    """Descriptor `fds[i]` becomes `targets[i]` (inheritable, like Popen's pass_fds); moved
    above every target first, so no target overwrites a descriptor still to be placed."""
    import fcntl
    if len(fds) != len(targets):
        raise ValueError(f"{len(fds)} descriptors for {len(targets)} targets")
    top = max(targets) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, top) for fd in fds]
    for fd in fds:
        os.close(fd)
    for h, t in zip(high, targets):
        os.dup2(h, t, inheritable=True)
        os.close(h)
