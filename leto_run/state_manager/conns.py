"""Who gets a connection slot on the state manager's socket, and for how long.

Role: the admission policy of `server.Server`, as a small table and a pure decision function.
Nothing here does I/O; `limits_from_env` parses the idle timeout from the knobs (`leto_runtime.wire.settings.raw()`).

Policy (why: a client that never speaks, or many of them, must not lock the others out):
* A peer that is registered when it connects (the state manager's parent, or a pid in the
  keeper's allow file) gets an *authenticated* slot at once: at most `max_conns` in all and
  `max_per_pid` per pid, so one process that leaks connections cannot take every slot.
* A peer not registered yet waits in a *pending* slot (at most `max_pending` at a time, each
  for at most `allow_wait` s) until the agent registers it.  Pending peers never occupy an
  authenticated slot, so a flood of unregistered connections cannot refuse a registered one.
* An authenticated connection idle for `idle_timeout` s (no request since its last reply) is
  closed after a `closing` message: the client reconnects; nothing it asked was lost.  The
  trainer's client keeps one connection for the whole job and reconnects on its next call.

Calling contract: `ConnTable` is thread-safe; `refusal` is pure.  Every tuning knob of the
socket's admission lives in `Limits`; `LETO_SM_IDLE_TIMEOUT` (seconds, > 0) is read only by
`limits_from_env`.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

from leto_runtime.wire import settings as S

IDLE_TIMEOUT_ENV = "LETO_SM_IDLE_TIMEOUT"
SEND_STALL_ENV = "LETO_SM_SEND_STALL"


@dataclass(frozen=True)
class Limits:
    max_conns: int = 64          # authenticated connections in all
    max_per_pid: int = 8         # authenticated connections of one process
    max_pending: int = 16        # connections waiting for their pid to be registered
    idle_timeout: float = 300.0  # seconds without a request before a connection is closed
    send_stall: float = 10.0     # seconds a reply message may wait for the peer to read

    def to_json(self) -> dict:
        return {"max_conns": self.max_conns, "max_per_pid": self.max_per_pid,
                "max_pending": self.max_pending, "idle_timeout_s": self.idle_timeout,
                "send_stall_s": self.send_stall}


def _seconds(environ: Mapping[str, str], var: str, default: float) -> tuple[float, str]:
    raw = environ.get(var)
    try:
        v = None if raw is None else S.seconds(var, raw)
    except S.SettingsError as e:
        return default, f"{e}; using {default:g} s"
    return (default if v is None else v), ""


def limits_from_env(environ: Mapping[str, str], base: Limits = Limits()) -> tuple[Limits, str]:
    """`base` with the idle timeout and the send stall from the environment's knobs; the second
    item says why a value was not used ("" if none was set or every one was used)."""
    idle, why_idle = _seconds(environ, IDLE_TIMEOUT_ENV, base.idle_timeout)
    stall, why_stall = _seconds(environ, SEND_STALL_ENV, base.send_stall)
    why = "; ".join(w for w in (why_idle, why_stall) if w)
    return Limits(base.max_conns, base.max_per_pid, base.max_pending, idle, stall), why


def refusal(lim: Limits, *, pending: bool, total: int, of_pid: int, waiting: int) -> str | None:
    """Why a new connection may not have the slot it asks for (None: it may).

    pending: it asks for a pending slot (its pid is not registered yet), else an authenticated
    one; total / of_pid: authenticated connections open now, in all / of its pid; waiting:
    pending connections open now."""
    if pending:
        if waiting >= lim.max_pending:
            return (f"{waiting} connections of unregistered processes are already waiting "
                    f"(at most {lim.max_pending}); registered processes are still served")
        return None
    if of_pid >= lim.max_per_pid:
        return (f"this process already has {of_pid} connections open (at most "
                f"{lim.max_per_pid} per process); close the ones it no longer uses")
    if total >= lim.max_conns:
        return f"{total} connections already open (at most {lim.max_conns})"
    return None


class ConnTable:
    """Counts of open slots; `take_*` return a refusal reason or None (slot taken)."""

    def __init__(self, lim: Limits):
        self.lim = lim
        self._lock = threading.Lock()
        self._auth: Counter[int] = Counter()
        self._pending = 0

    def take_pending(self) -> str | None:
        with self._lock:
            why = refusal(self.lim, pending=True, total=0, of_pid=0, waiting=self._pending)
            if why is None:
                self._pending += 1
            return why

    def take_auth(self, pid: int, from_pending: bool = False) -> str | None:
        """An authenticated slot for `pid`; `from_pending`: it leaves its pending slot too."""
        with self._lock:
            if from_pending:
                self._pending -= 1
            why = refusal(self.lim, pending=False, total=sum(self._auth.values()),
                          of_pid=self._auth[pid], waiting=self._pending)
            if why is None:
                self._auth[pid] += 1
            return why

    def leave(self, pid: int, authenticated: bool) -> None:
        with self._lock:
            if not authenticated:
                self._pending -= 1
                return
            self._auth[pid] -= 1
            if self._auth[pid] <= 0:
                del self._auth[pid]

    def stats(self) -> dict:
        with self._lock:
            return {"authenticated": sum(self._auth.values()), "pending": self._pending,
                    "pids": len(self._auth)}


class RateLimitedLog:
    """At most one line per `every` seconds (refusals of a connection flood); the lines held
    back are counted in the next one."""

    def __init__(self, log: Callable[[str], None], every: float = 1.0):
        self.log, self.every = log, every
        self._last = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        self.log(msg + (f" ({held} similar lines held back)" if held else ""))
