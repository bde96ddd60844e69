"""The cross-node HOF watcher of in-place recovery (`leto_run.inplace`).

`HofWatcher` is the thread that sees a HOF another node declared in the worker store and wakes
the agent's selector through a pipe (the loop then reads the key: `InplaceRecovery.on_wake`).
"""
from __future__ import annotations

import datetime
import os
import threading

import torch.distributed as dist

from leto_runtime.wire import contract as C

STORE_TIMEOUT_S = 30.0      # agent's worker-store client: connect and each operation
WATCH_POLL_S = 0.1          # watcher's poll of the HOF key (a non-blocking check per poll)


class HofWatcher:
    """Thread: polls `hof_key(generation)` in the worker store with non-blocking checks; writes
    one byte to `wake_fd` when it appears (another node declared a HOF).  Ends when the store
    goes away (restart, end of job) or `stop()`, which joins it.

    Why polling, not `store.wait`: a thread blocked inside the C++ wait cannot be stopped, and
    one still in it when the agent exits aborts the process ("terminate called without an
    active exception"); a timed-out wait also prints c10d warnings.  A check is one local TCP
    round trip, so 10 a second cost nothing and bound the detection delay to 0.1 s."""

    def __init__(self, addr: str, port: int, generation, wake_fd: int,
                 poll_s: float = WATCH_POLL_S):
        self.addr, self.port, self.generation, self.wake_fd = addr, port, generation, wake_fd
        self.poll = poll_s
        self.advanced = threading.Event()
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="leto-hof-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            store = dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        except Exception:
            return
        while not self._stopped.is_set():
            g = self.generation()
            try:
                seen = store.check([C.hof_key(g)])
            except Exception:
                return                      # the store is gone
            if not seen:
                self._stopped.wait(self.poll)
                continue
            try:
                os.write(self.wake_fd, b"h")
            except OSError:
                return
            while not self._stopped.is_set() and self.generation() == g:
                self.advanced.wait(1.0)     # until the agent handled generation g
                self.advanced.clear()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self.advanced.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
