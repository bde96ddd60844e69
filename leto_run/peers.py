"""The peer agents of a multi-node job: is each one still there?

A node whose agent is gone (the machine died, the agent was killed) takes its trainers, its
shadows and its retained state with it: the other nodes' trainers see only a closed connection,
which looks like the collateral of a HOF.  Recovering that in place would promote shadows that
wait for peers who never come, again and again.  So every agent beats in the round's store
(`leto/alive/<group rank>`, a counter, signed with the job's key where the store is an
`AuthStore`) every `timeout / 10` s and reads the others' counters; a peer whose counter has
not moved for `timeout` s (`--peer-timeout`), or a store that stays unreachable as long (its
host's agent is gone), is a lost node: the agent falls back to the checkpoint instead
(`leto_run.fallback`), and the next rendezvous round admits a replacement node.  A store call
that has not returned counts as silence from the moment it began: a stopped host (SIGSTOP, a
stalled machine) answers nobody, and its store's own timeout (60 s) is far beyond ours.  The
same thread reads another node's announced fallback (`start_plan.fallback_announced`), so
that the agent's loop makes no store call of its own.

The beats come from a thread of their own (`run`), not from the agent's loop: the loop may
wait in a policy for longer than the timeout (stopping a group grants its trainers a grace
period), and a node whose agent is alive is not lost.

Calling contract: the agent's main thread builds it, `start`s it before the round's start
agreement, `meet`s the round's nodes and `run`s it; `lost(now)`, `heard_since(t)` and `announced()` read
what the thread saw (under a lock never held across I/O); `close` ends the thread (it may finish one
store operation, bounded by the store's timeout).  `tick(now)` is the thread's one turn (tests
call it with the clock given).
"""
from __future__ import annotations

import threading
import time

from leto_run.start_plan import fallback_announced
from leto_runtime.control_auth import ForgedControlKey

KEY = "leto/alive/{}"
DONE = "leto/done/{}"          # this agent's workers all succeeded: silence from now is no loss


class PeerWatch:
    def __init__(self, store, group_rank: int, timeout: float, now: float):
        self.store, self.rank, self.timeout = store, group_rank, timeout
        self.interval = timeout / 10
        self.names: dict[int, str] = {}
        self.count = 0
        self.last_read = now
        self.unreachable: tuple[float, str] | None = None
        self.inflight: float | None = None     # when the store call under way began
        self.fallback: dict | None = None      # another node's announced fallback
        self.forged: ForgedControlKey | None = None
        self.done: set[int] = set()            # peers whose workers all succeeded
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Our counter exists before the round's start agreement, so every peer's does after."""
        self.store.set(KEY.format(self.rank), "0")

    def meet(self, nodes: list[str], now: float) -> None:
        """The round's nodes, in group-rank order (`start_plan.exchange`)."""
        with self.lock:
            self.names = {r: n for r, n in enumerate(nodes) if r != self.rank}
            self.value: dict[int, bytes | None] = dict.fromkeys(self.names)
            self.moved = dict.fromkeys(self.names, now)          # when its counter last moved
            self.alive_after = dict.fromkeys(self.names, -1.0)   # it beat after this time
            self.last_read = now

    def finish(self) -> None:
        try:
            self.store.set(DONE.format(self.rank), "1")
        except Exception:           # the store's host is gone: nobody is left to mistake us
            pass

    def run(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="leto-peer-beats", daemon=True)
        self.thread.start()

    def close(self, join: bool = False) -> None:
        """Stop beating; `join`: wait (bounded) until the thread is out of the store, so no
        thread is inside a C++ store call when the process exits."""
        self.stopped.set()
        if join and self.thread is not None:
            self.thread.join(self.interval + 2.0)

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval):
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """Beat, and read the peers' counters (I/O first, then the lock)."""
        if not self.names:
            return
        self.count += 1
        with self.lock:
            self.inflight = now
        try:
            self.store.set(KEY.format(self.rank), str(self.count))
            got = self.store.multi_get([KEY.format(r) for r in self.names])
            done = {r for r in self.names if self.store.check([DONE.format(r)])}
            fallback = self._announced()                  # read after the counters: see nodes
        except ForgedControlKey as e:
            with self.lock:
                self.forged, self.inflight = e, None
            return
        except Exception as e:      # the store's host (the rendezvous host's agent) is gone
            with self.lock:
                if self.unreachable is None:
                    self.unreachable = (self.inflight, f"{type(e).__name__}: {e}")
                self.inflight = None
            return
        with self.lock:
            self.unreachable, self.inflight = None, None
            self.done = done
            self.fallback = fallback or self.fallback
            for r, v in zip(self.names, got):
                if v != self.value[r]:
                    self.value[r], self.moved[r] = v, now
                    self.alive_after[r] = self.last_read
            self.last_read = now

    def _announced(self) -> dict | None:
        """Another node's fallback, read from the store; a value that does not parse is no
        announcement (and no sign that the store is gone: the beats just read stand)."""
        try:
            fb = fallback_announced(self.store)
        except (ValueError, TypeError, KeyError):
            return None
        return fb if isinstance(fb, dict) else None

    def grace(self, now: float) -> None:
        """The agent was away (`decisions.stall_verdict`): nothing it read during that time
        is a peer's silence, so every peer, and an unreachable store, count from `now`."""
        with self.lock:
            self.moved = {r: max(t, now) for r, t in getattr(self, "moved", {}).items()}
            if self.unreachable is not None:
                self.unreachable = (max(self.unreachable[0], now), self.unreachable[1])
            if self.inflight is not None:
                self.inflight = max(self.inflight, now)

    def announced(self) -> dict | None:
        """Another node's fallback of this round, as the thread last read it (or None)."""
        with self.lock:
            return self.fallback

    def heard_since(self, t: float) -> bool:
        """Has every peer beaten after time `t`?"""
        with self.lock:
            return all(a >= t for a in self.alive_after.values())

    def lost(self, now: float) -> str | None:
        """Why a peer node counts as lost now, or None.  Raises the forged value a peer's
        counter carried (exit 5, as for every forged control value)."""
        with self.lock:
            if self.forged is not None:
                raise self.forged
            if self.unreachable and now - self.unreachable[0] > self.timeout:
                return (f"the job's store has been unreachable for "
                        f"{now - self.unreachable[0]:.1f} s ({self.unreachable[1]}): the node "
                        "hosting it is lost")
            if self.inflight is not None and now - self.inflight > self.timeout:
                return (f"the job's store has not answered for {now - self.inflight:.1f} s "
                        f"(--peer-timeout {self.timeout:g} s): the node hosting it is lost")
            gone = [f"{self.names[r]} (group rank {r}, silent for {now - t:.1f} s)"
                    for r, t in self.moved.items()
                    if now - t > self.timeout and r not in self.done]
        return (f"node(s) lost: {', '.join(gone)} (--peer-timeout {self.timeout:g} s)"
                if gone else None)
