"""The peer agents of a multi-node job: is each one still there?

A node whose agent is gone (the machine died, the agent was killed) takes its trainers, its
shadows and its retained state with it: the other nodes' trainers see only a closed connection,
which looks like the collateral of a HOF.  Recovering that in place would promote shadows that
wait for peers who never come, again and again.  So every agent beats in the round's store
(`leto/alive/<group rank>`, a counter, signed with the job's key where the store is an
`AuthStore`) every `timeout / 10` s and reads the others' counters; a peer whose counter has
not moved for `timeout` s (`--peer-timeout`), or a store that stays unreachable as long (its
host's agent is gone), is a lost node: the agent falls back to the checkpoint instead
(`leto_run.fallback`), and the next rendezvous round admits a replacement node.

Calling contract: the agent's main thread; `tick(now)` once per loop turn (it acts every
interval; `next_due` is the loop's deadline), `lost(now)` and `heard_since(t)` read what it saw.
Each store operation is bounded by the store's timeout.
"""
from __future__ import annotations

from leto_runtime.control_auth import ForgedControlKey

KEY = "leto/alive/{}"


class PeerWatch:
    def __init__(self, store, group_rank: int, timeout: float, now: float):
        self.store, self.rank, self.timeout = store, group_rank, timeout
        self.interval = timeout / 10
        self.names: dict[int, str] = {}
        self.count = 0
        self.last_read = now
        self.unreachable: tuple[float, str] | None = None
        self.next_due = now

    def start(self) -> None:
        """Our counter exists before the round's start agreement, so every peer's does after."""
        self.store.set(KEY.format(self.rank), "0")

    def meet(self, nodes: list[str], now: float) -> None:
        """The round's nodes, in group-rank order (`start_plan.exchange`)."""
        self.names = {r: n for r, n in enumerate(nodes) if r != self.rank}
        self.value: dict[int, bytes | None] = dict.fromkeys(self.names)
        self.moved = dict.fromkeys(self.names, now)          # when its counter last moved
        self.alive_after = dict.fromkeys(self.names, -1.0)   # it beat after this time
        self.last_read = now

    def tick(self, now: float) -> None:
        if now < self.next_due or not self.names:
            return
        self.next_due = now + self.interval
        self.count += 1
        try:
            self.store.set(KEY.format(self.rank), str(self.count))
            got = self.store.multi_get([KEY.format(r) for r in self.names])
        except ForgedControlKey:
            raise
        except Exception as e:      # the store's host (the rendezvous host's agent) is gone
            if self.unreachable is None:
                self.unreachable = (now, f"{type(e).__name__}: {e}")
            return
        self.unreachable = None
        for r, v in zip(self.names, got):
            if v != self.value[r]:
                self.value[r], self.moved[r] = v, now
                self.alive_after[r] = self.last_read
        self.last_read = now

    def heard_since(self, t: float) -> bool:
        """Has every peer beaten after time `t`?"""
        return all(a >= t for a in self.alive_after.values())

    def lost(self, now: float) -> str | None:
        """Why a peer node counts as lost now, or None."""
        if self.unreachable and now - self.unreachable[0] > self.timeout:
            return (f"the job's store has been unreachable for {now - self.unreachable[0]:.1f} "
                    f"s ({self.unreachable[1]}): the node hosting it is lost")
        gone = [f"{self.names[r]} (group rank {r}, silent for {now - t:.1f} s)"
                for r, t in self.moved.items() if now - t > self.timeout]
        return (f"node(s) lost: {', '.join(gone)} (--peer-timeout {self.timeout:g} s)"
                if gone else None)
