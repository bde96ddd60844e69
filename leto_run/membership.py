"""Agents waiting to join a multi-node job, counted off the agent's loop.

Role: torchrun's monitor loop asks the rendezvous, once per monitor interval, how many agents
wait to join (`num_nodes_waiting`), and restarts the group to admit them.  It asks on its own
thread: a store whose host is stopped (SIGSTOP, a stalled machine) answers nobody, and the
call then waits out the store's timeout (60 s) while a trainer's death, a hang or a lost peer
go unhandled.  Here a thread of the round asks, and the loop takes what it last heard, never
waiting.

Calling contract: the agent's main thread `start`s one per rendezvous round of a multi-node job
and `close`s it when the round's supervision ends; before the next rendezvous it `close(join_s)`s
it again, so that the handler is not used from two threads at once (bounded: a store call
ends by the store's timeout).  `take()` returns the
newest count not yet taken (0 when none, or when the store did not answer: a peer that is gone
is the beats' business, `leto_run.peers`) and raises the ForgedControlKey the thread met.
"""
from __future__ import annotations

import threading
from typing import Callable

from leto_runtime.control_auth import ForgedControlKey

# Long enough for one store call to end by the store's own timeout (c10d's: 60 s).
JOIN_S = 65.0


class MembershipProbe:
    def __init__(self, count: Callable[[], int], interval: float, log: Callable[[str], None]):
        self.count, self.interval, self.log = count, interval, log
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.waiting = 0
        self.forged: ForgedControlKey | None = None
        self.failed: str | None = None          # the last error, until the store answers again
        self.said: str | None = None            # the error the loop last logged
        self.thread = threading.Thread(target=self._loop, name="leto-membership", daemon=True)

    def start(self) -> "MembershipProbe":
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval):
            self.read_once()

    def read_once(self) -> None:
        """One question to the rendezvous (I/O first, then the lock)."""
        try:
            n, err, forged = self.count(), None, None
        except ForgedControlKey as e:
            n, err, forged = 0, None, e
        except Exception as e:      # the store's host is gone or stopped: the beats judge it
            n, err, forged = 0, f"{type(e).__name__}: {e}", None
        with self.lock:
            self.waiting = max(self.waiting, n)
            self.failed = err
            self.forged = self.forged or forged

    def take(self) -> int:
        with self.lock:
            n, self.waiting = self.waiting, 0
            forged, failed = self.forged, self.failed
        if forged is not None:
            raise forged
        if failed != self.said:
            self.said = failed
            if failed:
                self.log(f"rendezvous store unreachable ({failed})")
        return n

    def close(self, join_s: float = 0.0) -> None:
        """Stop asking; `join_s`: wait (bounded) until the thread is out of the handler."""
        self.stopped.set()
        if join_s > 0 and self.thread.is_alive():
            self.thread.join(join_s)
            if self.thread.is_alive():
                self.log(f"warning: the membership probe is still in a store call after "
                         f"{join_s:g} s")
