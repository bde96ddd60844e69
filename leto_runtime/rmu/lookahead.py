"""How far the update's host runs ahead of the GPU (CUDA, stream-ordered markers).

Why: a trainer killed while its queued GPU work still runs can be promoted past before its exit
fence only if that work ends before the driver's teardown stops it (leto_runtime/drain.py:
the drain words then prove it done); the teardown stops a dead context's kernels soon after
the kill, and its fence comes several times later (docs/BENCHMARKS.md, "When a killed
trainer's kernels stop writing").  Unbounded, the host queues a whole group's chunks and then
spends the phase launching and in one final wait; a death mid-update then leaves tens of
milliseconds of queued work and the fence decides.  Bounded to `depth` chunks queued behind
the one the GPU runs, the host spends most of the update in short waits inside a closed drain
window, each leaving at most `depth + 1` chunks of the current stream's work queued (besides the
side stream's parity copies, which the drain's sentinels cover too), and launches the next
chunk while the GPU still has `depth` to run: no bubble as long as a chunk's launches take
less host time than a chunk takes on the device.  It applies wherever the markers are
stream-ordered, the drain on or not (its cost is measured where there is no drain, in
benchmarks/rmu_overhead.py); only the drain makes a death in its waits provable.

Calling contract: `Lookahead(depth, close, open_, inject)`, `depth` 0 = off (no waits);
`queued(t, g, j)` after each chunk's work and commit are queued on the current stream: once
more than `depth` chunks are pending it waits for the oldest (chunk j - depth, possibly of
the previous group); `clear()` at the start of each update run (what an abandoned run left
pending has run or will run before anything queued later).  `close()` / `open_()` are the
updater's drain window (close before the host waits, open after); `inject(point, **where)`
its fault point, fired inside the closed window.  `event()` makes a recorded marker of the
current stream's progress with `synchronize()` (torch.cuda.Event by default).
"""
from __future__ import annotations

from collections import deque


def _cuda_event():
    import torch
    ev = torch.cuda.Event()
    ev.record()
    return ev


class Lookahead:
    def __init__(self, depth: int, close, open_, inject, event=_cuda_event):
        self.depth, self.close, self.open_, self.inject = depth, close, open_, inject
        self.event = event
        self.pending: deque = deque()

    @property
    def on(self) -> bool:
        return self.depth > 0

    def queued(self, t: int, g: int, j: int) -> None:
        """Chunk j of group g is queued: wait (window closed) until no more than `depth`
        chunks are queued behind the one the GPU runs."""
        if not self.on:
            return
        self.pending.append(self.event())
        if len(self.pending) <= self.depth:
            return
        oldest = self.pending.popleft()
        self.close()
        self.inject("rmu.lookahead", step=t, group=g, chunk=j)
        oldest.synchronize()
        self.open_()

    def clear(self) -> None:
        self.pending.clear()
