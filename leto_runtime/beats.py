"""Heartbeats from a trainer to its agent, and the runtime's side of failure injection.

(The module is `beats`; the package exports its function `heartbeat`.)

`heartbeat(step)` is the one-call API for scripts that do not use the rest of the runtime:
call it once per training step from the training loop's thread.  It sends one datagram (no
reply, never blocks: a full socket buffer drops the beat, which only makes the agent *more*
cautious), so it costs a few microseconds.  Calling it from the loop's thread is the point: a
background thread would keep beating while the loop is stuck.

On the first call it also arms the stack dump (faulthandler on the agent's dump signal, so a
hung rank's Python stacks reach its stderr log before the agent kills it) and the handler for
injected hangs; and at each call it fires this rank's step-triggered injections, which are
real signals sent to itself (SIGKILL, SIGSEGV, ...) or a real block of the main thread.

Here only injections at the start of a step fire (`at` absent or "step"), and only in the
generation they name (`gen`, default 0).  Under the runtime API (`leto_runtime.job`),
`leto_runtime.faults.Faults` takes the whole plan over and fires every point of
`contract.INJECT_POINTS` itself (RMU operations, recovery phases, page losses with their kill).

`send(kind, step, detail)` is the raw datagram API that `leto_runtime.promotion` builds on
(kinds: `contract` "Heartbeat datagram").  Beats never block; a control datagram waits at most
CONTROL_SEND_S for room in the agent's queue.

The process's channel (`Channel`: the socket, the identity the datagrams carry, the step
injections still to fire) is `channel()`, kept in the process's runtime object
(`leto_runtime.runtime`).  `leto_runtime.faults` takes its plan over with `take_plan()`.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import time

from leto_runtime.wire import contract as C
from leto_runtime import runtime
from leto_runtime.context import Context

CONTROL_SEND_S = 2.0     # longest a control datagram waits for room in the agent's queue


class Channel:
    """This process's datagrams to its agent (see the module docstring).  Never raises."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.sock: socket.socket | None = None
        self.plan: list[dict] = list(ctx.inject_plan)
        if ctx.under_leto and ctx.heartbeat_socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            s.setblocking(False)
            self.sock = s
            faulthandler.register(ctx.dump_signal, file=sys.stderr, all_threads=True, chain=False)
            signal.signal(C.HANG_SIGNAL, _hang_handler)

    def send(self, kind: str, step: int | None, detail: str | None = None) -> None:
        if self.sock is None:
            return
        ctx = self.ctx
        msg = {"v": C.HEARTBEAT_VERSION, "kind": kind, "rank": ctx.rank, "role": ctx.role,
               "gen": ctx.generation, "pid": os.getpid(), "step": step, "detail": detail,
               "t": time.monotonic()}     # when it was sent (one clock per machine)
        data = json.dumps(msg, separators=(",", ":")).encode()
        # A Unix datagram queue holds only net.unix.max_dgram_qlen (often 10) messages; while the
        # agent is busy (spawning shadows during a recovery) it fills.  A lost beat only makes
        # the agent more cautious, but a lost control datagram (demoted, promoted, phase, ...)
        # loses a protocol step or a report figure: those are retried, bounded.
        deadline = None if kind == "beat" else time.monotonic() + CONTROL_SEND_S
        while True:
            try:
                self.sock.sendto(data, ctx.heartbeat_socket)
                return
            except BlockingIOError:
                if deadline is None or time.monotonic() >= deadline:
                    return
                time.sleep(0.001)
            except (FileNotFoundError, ConnectionRefusedError, OSError):
                return   # the agent is gone; the parent-death signal handles that

    def take_plan(self) -> None:
        """The runtime API (`leto_runtime.faults`) fires every planned injection itself, at its
        point and generation: the bare heartbeat must not fire them again at a replayed step."""
        self.plan = []

    def rebind(self) -> None:
        """The environment changed under this process (an in-process demotion made it a shadow
        of a new generation): datagrams say the new role and generation from now on."""
        self.ctx = Context.from_env()
        self.plan = []

    def fire_step_injections(self, step: int) -> None:
        for inj in list(self.plan):
            if not self._matches(inj, step):
                continue
            self.plan.remove(inj)
            self.send("inject", step, inj.get("text") or inj.get("kind"))
            kind = inj.get("kind")
            if kind == "pages":
                # Synchronous: the pages are gone before this step touches them.
                from leto_runtime.rmp.faults import fire_pages_spec
                fire_pages_spec(self.ctx.sm_socket, inj.get("params") or {})
                continue
            if kind == "hang":
                block_forever(f"injected hang at step {step} ({inj.get('text')})")
            sig = int(inj.get("signal") or signal.SIGKILL)
            sys.stderr.flush()
            sys.stdout.flush()
            os.kill(os.getpid(), sig)
            time.sleep(1.0)     # a catchable signal with a handler may return; the kill still stands

    def _matches(self, inj: dict, step: int) -> bool:
        if inj.get("step") is None or step < inj["step"]:
            return False
        return (int(inj.get("gen") or 0) == self.ctx.generation
                and (inj.get("at") or "step") == "step")


def channel() -> Channel:
    """The process's channel, created (and registered with the agent) on first use."""
    rt = runtime.current()
    if rt.channel is None:
        rt.channel = Channel(Context.from_env())
        rt.channel.send("register", None)
    return rt.channel


def _opened() -> Channel | None:
    return runtime.current().channel


def block_forever(reason: str) -> None:
    sys.stderr.write(f"[leto_runtime] {reason}: blocking the training loop\n")
    sys.stderr.flush()
    while True:          # a real hang: the main thread never returns to the training loop
        time.sleep(3600)


def _hang_handler(signum, frame) -> None:
    block_forever("injected hang (signal from the agent)")


def send(kind: str, step: int | None = None, detail: str | None = None) -> None:
    """Send one datagram of `kind` (see contract) to the agent; never raises; a control datagram waits at most CONTROL_SEND_S for room."""
    channel().send(kind, step, detail)


def rebind() -> None:
    """The environment changed under this process (see `Channel.rebind`)."""
    ch = _opened()
    if ch is not None:
        ch.rebind()


def heartbeat(step: int | None = None) -> None:
    """Tell the agent this rank is alive (and at `step`).  Cheap; call once per step."""
    ch = channel()
    if step is not None and ch.plan:
        ch.fire_step_injections(step)
    ch.send("beat", step)


def collective(step: int | None = None) -> None:
    """A beat that says: this rank now waits for its peers in a collective.  If it stays silent
    there while a peer stays silent outside one, the agent blames the peer for the hang
    (`leto_run.decisions.blame_hangs`), so this rank is demoted, not killed as the culprit."""
    channel().send("beat", step, "collective")


def left_collective(step: int | None = None) -> None:
    """The collective `collective()` announced returned: a silent rank from now on is not
    waiting for its peers."""
    ch = _opened()
    if ch is not None:
        ch.send("beat", step, None)


def done() -> None:
    """The training loop finished: the time until exit (saving, teardown) is not a hang."""
    ch = _opened()
    if ch is not None:
        ch.send("bye", None)
