"""RMU's per-chunk copies and parity deltas on CPU, looked up once and then replayed.

On CPU RMU's chunks are small (the demo's and the CPU benchmark's 8 pages of 16 KiB), and
finding and checking a chunk's pages -- a tensor view over the retained mapping per page run,
page lists, address arrays -- cost several times the arithmetic itself (`rmu_overhead.py
--device cpu --model small`, docs/BENCHMARKS.md).  A chunk's pages do not move while an Updater
lives (a new mapping gets a new Updater: job.py rebinds it), so each chunk's undo copy and
each (chunk, authoritative buffer, undo slot)'s parity delta are looked up once and replayed
from the pages' addresses afterwards: `ctypes.memmove` for the undo copy,
`ParityCode.prepare_update` for Q' = Q ^ RS_j(U ^ C_j).  Same operations in the same order,
same bits (the parity kernel is the one update() runs on CPU).

Nothing here keeps a tensor view (a live view would hold the mapping past its unmapping:
rmp.tensors.ViewRegistry).  As a guard, `check()` compares the states' base addresses with
those the calls were prepared for and drops every prepared call when they differ.

Calling contract: `ChunkCalls(ss)` for a CPU StateSet; `check()` before each update or resume;
`undo_copy(g, j, slot)`; `parity_delta(g, j, auth, slot, code)` returns False where the delta
cannot be prepared (a plan other than pagewise: the caller then runs ParityCode.update);
`clear()` when the Updater closes.
"""
from __future__ import annotations

import ctypes

import torch


class ChunkCalls:
    def __init__(self, ss) -> None:
        if torch.device(ss.device).type != "cpu":
            raise ValueError(f"ChunkCalls is the CPU path; the states are on {ss.device}")
        self.ss = ss
        self._calls: dict[tuple, object] = {}
        self._sig: tuple | None = None

    @property
    def prepared(self) -> int:
        """How many chunk calls are prepared now (replayed on their next use; `check()` drops
        them all when a state's pages moved)."""
        return len(self._calls)

    def _signature(self) -> tuple:
        ss = self.ss
        return tuple(int(st.pages(0, 1).data_ptr()) for st in (*ss.model, ss.undo, ss.qbuf))

    def check(self) -> None:
        """Drop the prepared calls if any state's pages moved since they were prepared."""
        sig = self._signature()
        if sig != self._sig:
            self._calls.clear()
            self._sig = sig

    def clear(self) -> None:
        self._calls.clear()
        self._sig = None

    def _span(self, g: int, j: int) -> tuple[int, int, int]:
        first, count = self.ss.chunks(g)[j]
        return first, count, self.ss.model[0].groups[g].first + first

    def undo_copy(self, g: int, j: int, slot: int) -> None:
        """U <- C_j for params, exp_avg and exp_avg_sq (undo slot `slot`)."""
        key = ("undo", g, j, slot)
        moves = self._calls.get(key)
        if moves is None:
            ss = self.ss
            _, count, p0 = self._span(g, j)
            moves = []
            for i, st in enumerate(ss.model):
                dst, src = ss.undo_pages(i, count, slot), st.pages(p0, count)
                moves.append((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
            self._calls[key] = moves
        for dst, src, n in moves:
            ctypes.memmove(dst, src, n)

    def parity_delta(self, g: int, j: int, auth: int, slot: int, code) -> bool:
        """Q'(1 - auth) <- Q(auth) ^ RS_j(U ^ C_j) for each state; False if not preparable."""
        key = ("delta", g, j, auth, slot)
        calls = self._calls.get(key)
        if calls is None:
            ss = self.ss
            first, count, p0 = self._span(g, j)
            prepared = [code.prepare_update(ss.q(i, 1 - auth, g), range(first, first + count),
                                            ss.undo_pages(i, count, slot), st.pages(p0, count),
                                            base=ss.q(i, auth, g))
                        for i, st in enumerate(ss.model)]
            calls = prepared if all(c is not None for c in prepared) else False
            self._calls[key] = calls
        if calls is False:
            return False
        for c in calls:
            c()
        return True
