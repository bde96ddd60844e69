"""The data path of one RMU chunk transaction: undo copy, AdamW, parity delta.

For chunk j of group g -- params, exp_avg and exp_avg_sq together -- `ChunkOps` does the work
that `updater.Updater._chunk` makes a transaction of, on the fastest path checked for the
device, with the same bits on every path:

* `undo(t, g, j)`: the chunk's pages -> undo slot `slot(g, j)`, or the copy `queue_undo` queued
  earlier waited for;
* where `one_kernel`, `update_with_delta(...)`: the chunk's AdamW from its undo copy and
  Q' = Q ^ delta for each state in one kernel (`fused.chunk_syndrome_`);
* otherwise `update(...)` -- the fused AdamW kernel that also writes the delta pages old ^ new
  (CUDA), or `adamw.adamw_chunk_` -- then `parity_delta(...)`: Q' = Q ^ RS_j(U ^ C_j), written
  into the other parity buffer, from the delta pages in one batched launch
  (`ParityCode.update_delta_many`), replayed (CPU) or through `ParityCode.update`;
* `garbage(...)`: what a kill inside a kernel leaves (fault injection).

Nothing here writes the marker or fires an injection point: the updater puts those between
these calls, and what the marker claims rests on that order (updater.py).

CPU path: each chunk's undo copy and parity delta are looked up once per Updater and replayed
from the pages' addresses (`cpu_chunks.ChunkCalls`; same kernels, same bits): on CPU's small
chunks the lookups had cost ~4x the arithmetic.

Undo slots (`slots`, LETO_RMU_UNDO_PIPELINE=1 where the chunk runs as one kernel or on CPU):
the undo state's two halves are two undo slots, alternating over the update's chunks; on CUDA
`queue_undo` queues chunk j+1's undo copy on its own stream while chunk j's kernel runs, and the
marker's `sub` = 1 + slot says where the undo copy of the uncommitted chunk is.

Calling contract: one `ChunkOps` per `Updater` (the states' pages do not move meanwhile:
cpu_chunks.py); `check()` before each update or resume; per chunk `operands`, then with
transactions `undo` and `queue_undo`, then `update_with_delta`, or `update` and (with
transactions) `parity_delta`; `quiesce()` at a step boundary; `close()` with the updater.
"""
from __future__ import annotations

import torch

from leto_runtime.rmu import adamw as A
from leto_runtime.rmu import fold as FD
from leto_runtime.rmu.cpu_chunks import ChunkCalls


class ChunkOps:
    """`code(k)` is the updater's parity code of k-page groups, `fence()` its fence; `fused`
    and `one_kernel` its fused kernels (`fused.Fused`, checked on this device)."""

    def __init__(self, ss, cfg: "A.AdamWConfig", *, gflat: torch.Tensor, code, fence,
                 transactions: bool, fused, one_kernel: bool, slots: int, plan=None,
                 group_kernel=None):
        self.ss, self.cfg, self.transactions, self.plan = ss, cfg, transactions, plan
        # With a plan, on CUDA with transactions: `group_kernel(h)` -> the fused AdamW kernel
        # checked for group values h (fused.for_group), or None (that group takes torch ops).
        self.group_kernel = group_kernel
        self.code, self.fence = code, fence
        self.fused, self.one_kernel, self.slots = fused, one_kernel, slots
        self.flat = [ss.flat(st) for st in ss.model]
        self.gflat = gflat
        self.E = ss.geo.page_bytes // 4                   # fp32 elements per page
        self.scratch = None
        cuda = str(ss.device).startswith("cuda")
        self.undo_stream = torch.cuda.Stream(device=ss.device) if cuda and slots == 2 else None
        self._undone: tuple | None = None        # (t, group, chunk, event) of a queued undo copy
        nc = [len(ss.chunks(g)) for g in range(len(ss.model[0].groups))]
        self._chunk_base = [sum(nc[:g]) for g in range(len(nc))]
        # CPU: each chunk's undo copy and parity delta looked up once, then replayed (cpu_chunks.py)
        self._cpu = None if cuda else ChunkCalls(ss)

    def check(self) -> None:
        """Before an update or a resume: replayed CPU calls whose pages moved are dropped."""
        if self._cpu is not None:
            self._cpu.check()

    def close(self) -> None:
        if self._cpu is not None:
            self._cpu.clear()

    def quiesce(self) -> None:
        """A queued undo copy no chunk consumed ends before anything queued from here on."""
        if self._undone is not None:
            torch.cuda.current_stream().wait_event(self._undone[-1])
        self._undone = None

    # ---- the undo copy ---------------------------------------------------------------------
    def slot(self, g: int, j: int) -> int:
        """The undo slot of chunk j of group g: alternating over the update's chunks."""
        return (self._chunk_base[g] + j) % self.slots

    def _copy_undo(self, g: int, j: int) -> None:
        s = self.slot(g, j)
        if self._cpu is not None:
            self._cpu.undo_copy(g, j, s)
            return
        first, count = self.ss.chunks(g)[j]
        p0 = self.ss.model[0].groups[g].first + first
        for i in range(3):
            self.ss.undo_pages(i, count, s).copy_(self.ss.model[i].pages(p0, count))

    def undo(self, t: int, g: int, j: int) -> None:
        """Chunk j of group g's undo copy: the one `queue_undo` queued (the current stream
        waits for it), else made now; a queued copy of another chunk is waited for first."""
        pre, self._undone = self._undone, None
        if pre is not None:
            torch.cuda.current_stream().wait_event(pre[3])     # mine, or one to outwait
        if pre is None or pre[:3] != (t, g, j):
            self._copy_undo(g, j)

    def queue_undo(self, t: int, g: int, j: int) -> None:
        """Queue chunk j of group g's undo copy on the undo stream (CUDA, two slots), after
        everything queued so far on the current stream: that includes the last reader of its
        slot (chunk j-2's kernel), not the kernel queued next (chunk j-1's, which reads the
        other slot).  Safe without a marker change: nothing reads an undo slot before the
        marker says so (sub = 1 + slot), and that write waits for the copy (`undo`)."""
        if self.undo_stream is None:
            return
        if j >= len(self.ss.chunks(g)):
            g, j = g + 1, 0
        if g >= len(self.ss.model[0].groups):
            return
        self.undo_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.undo_stream):
            self._copy_undo(g, j)
            ev = torch.cuda.Event()
            ev.record(self.undo_stream)
        self._undone = (t, g, j, ev)

    # ---- AdamW and the parity delta --------------------------------------------------------
    def _elems(self, g: int, first: int, count: int) -> slice:
        p0 = self.ss.model[0].groups[g].first + first
        return slice(p0 * self.E, (p0 + count) * self.E)

    def operands(self, g: int, chunk: tuple[int, int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The chunk's views of params, exp_avg and exp_avg_sq, and of the gradients."""
        first, count = chunk
        sl = self._elems(g, first, count)
        views = [f[sl] for f in self.flat]
        grad = self.gflat[sl]
        if self.scratch is None:
            # RMP memory (lent outside the update) where it is free; with two undo slots it is
            # not, and only the torch-ops path (CPU) needs one: a plain allocation there
            self.scratch = (self.ss.scratch() if self.slots == 1 else None if self.one_kernel
                            else torch.empty(self.ss.chunk_pages * self.E, dtype=torch.float32,
                                             device=self.gflat.device))
        return views, grad

    def update_with_delta(self, t: int, g: int, j: int, chunk: tuple[int, int], views, grad,
                          coef, lr: float, auth: int) -> None:
        """One kernel: the chunk's AdamW from its undo copy, and Q' = Q ^ delta for each state."""
        undo, kw = self._kernel_args(g, j, chunk, auth)
        self.fused.chunk_syndrome_(views, undo, grad, step=t + 1, lr=lr, coef=coef, **kw)

    def _kernel_args(self, g: int, j: int, chunk: tuple[int, int], auth: int):
        """The one-kernel chunk's undo pages and its parity arguments (Q' = buffer 1 - auth)."""
        ss = self.ss
        first, count = chunk
        undo = [ss.undo_pages(i, count, self.slot(g, j)) for i in range(3)]
        return undo, dict(code=self.code(ss.model[0].groups[g].k), first=first,
                          outs=[ss.q(i, 1 - auth, g) for i in range(3)], bases=[ss.q(i, auth, g) for i in range(3)])

    def update(self, t: int, g: int, chunk: tuple[int, int], views, grad, coef, lr: float | None):
        """AdamW in place on the chunk; returns the delta pages the fused kernel wrote (with
        transactions, on CUDA), else None."""
        count = chunk[1]
        if self.plan is not None:
            return self._update_groups(t, views, grad, coef, lo=self._elems(g, *chunk).start,
                                       count=count)
        if self.fused is not None and self.transactions:
            deltas = [self.ss.delta_pages(i, count) for i in range(3)]
            self.fused.step_(views[0], views[1], views[2], grad, step=t + 1, lr=lr, coef=coef,
                             deltas=deltas)
        else:
            deltas = None
            A.adamw_chunk_(views[0], views[1], views[2], grad, step=t + 1, lr=lr, cfg=self.cfg,
                           coef=coef, scratch=self.scratch[:grad.numel()])
        return deltas

    def _update_groups(self, t: int, views, grad, coef, lo: int, count: int):
        """The plan's update: each part of the chunk that lies in a parameter group with that
        group's values (frozen parameters and padding after the last group are left alone).
        Returns the delta pages when every part ran in the fused kernel (CUDA), else None."""
        from leto_runtime.rmu.chunk_math import update_chunk_
        pieces = list(self.plan.pieces(lo, lo + grad.numel()))
        kernels = ([self.group_kernel(h) for _, _, h in pieces] if self.group_kernel is not None
                   else None)
        if kernels and all(k is not None for k in kernels):
            return self._fused_groups(t, views, grad, coef, pieces, kernels, count)
        sc = self.scratch
        for a, b, h in pieces:
            update_chunk_(h, views[0][a:b], tuple(v[a:b] for v in views[1:1 + h.n_states]),
                          grad[a:b], step=t + 1, coef=coef, scratch=sc[:b - a])
        return None

    def _fused_groups(self, t: int, views, grad, coef, pieces, kernels, count: int):
        """One fused AdamW launch per part, each with its group's values, writing old ^ new into
        the delta pages; the delta of elements in no group (frozen, padding) is 0, as nothing
        changes there.  The kernel takes torch's float32 step counter (chunk_math: it stops at
        2**24)."""
        from leto_runtime.rmu.chunk_math import F32_STEP_LIMIT
        deltas = [self.ss.delta_pages(i, count) for i in range(3)]
        flat = [d.reshape(-1).view(torch.int32) for d in deltas]
        step, done = min(t + 1, F32_STEP_LIMIT), 0
        for (a, b, h), k in zip(pieces, kernels):
            if a > done:
                for d in flat:
                    d[done:a].zero_()
            k.step_(views[0][a:b], views[1][a:b], views[2][a:b], grad[a:b], step=step, lr=h.lr,
                    coef=coef, deltas=[d[a:b] for d in flat])
            done = b
        if done < grad.numel():
            for d in flat:
                d[done:].zero_()
        return deltas

    def parity_delta(self, g: int, j: int, chunk: tuple[int, int], auth: int, deltas) -> None:
        """Q[1-auth] = Q[auth] ^ RS_j(undo ^ new) for each state, from `deltas` (`update`'s) or
        from the undo copy."""
        ss = self.ss
        first, count = chunk
        gi = ss.model[0].groups[g]
        idx = range(first, first + count)
        code = self.code(gi.k)
        # Q' = Q ^ delta, written straight into the scratch parity buffer (no copy of Q).
        if deltas is not None:
            code.update_delta_many([ss.q(i, 1 - auth, g) for i in range(3)], idx, deltas,
                                   bases=[ss.q(i, auth, g) for i in range(3)])
        elif self._cpu is None or not self._cpu.parity_delta(g, j, auth, self.slot(g, j), code):
            for i, st in enumerate(ss.model):
                code.update(ss.q(i, 1 - auth, g), idx, ss.undo_pages(i, count, self.slot(g, j)),
                            st.pages(gi.first + first, count), base=ss.q(i, auth, g), scratch=self.scratch)

    # ---- the folded chunk (fold.py) ----------------------------------------------------------
    def fold_update(self, t: int, g: int, j: int, chunk: tuple[int, int], views, grad, coef, lr,
                    auth: int, kernel: bool) -> None:
        """The chunk with its undo copy folded in: `kernel` (CUDA, fused.fold_ok) in one kernel
        that leaves per-unit stage counts; otherwise the same protocol in order -- the undo
        copy, every unit counted, then the update and the parity delta."""
        ss = self.ss
        first, count = chunk
        tg = FD.tag(t, *ss.chunk_index(g, j))
        counts = [ss.fold_counts(c) for c in range(2)]
        if kernel:
            undo, kw = self._kernel_args(g, j, chunk, auth)
            self.fused.chunk_fold_(views, undo, grad, step=t + 1, lr=lr, coef=coef, counts=counts, tag=tg, **kw)
            return
        self._copy_undo(g, j)
        FD.count_all_(counts, tg, count)
        deltas = self.update(t, g, chunk, views, grad, coef, lr)
        self.parity_delta(g, j, chunk, auth, deltas)

    def fold_garbage(self, t: int, g: int, j: int, chunk: tuple[int, int], scratch_buf: int) -> None:
        """What a kill inside the folded kernel leaves (fold.garbage_), and torn scratch parity."""
        ss = self.ss
        first, count = chunk
        p0 = ss.model[0].groups[g].first + first
        gen = torch.Generator().manual_seed(0xF01D)
        FD.garbage_([st.pages(p0, count) for st in ss.model], [ss.undo_pages(i, count, 0) for i in range(3)],
                    [ss.fold_counts(c) for c in range(2)], FD.tag(t, *ss.chunk_index(g, j)), gen)
        self.scratch_garbage(g, scratch_buf)

    def scratch_garbage(self, g: int, scratch_buf: int) -> None:
        """A third of each state's scratch parity buffer overwritten with random bytes."""
        gen = torch.Generator().manual_seed(0x5C7A)
        for i in range(3):
            q = self.ss.q(i, scratch_buf, g)
            qn = torch.randint(0, 256, (q.numel() // 3,), generator=gen, dtype=torch.uint8)
            q.view(-1)[:qn.numel()].copy_(qn.to(q.device))
        self.fence()

    def garbage(self, g: int, first: int, count: int, scratch_buf: int) -> None:
        """What a kill inside a kernel leaves: part of the chunk and of the scratch parity
        overwritten with random bytes (the paper injects this with NVBit)."""
        ss = self.ss
        gi = ss.model[0].groups[g]
        gen = torch.Generator().manual_seed(0xBAD)
        for st in ss.model:
            pages = st.pages(gi.first + first, count)
            half = max(1, pages.numel() // 2)
            noise = torch.randint(0, 256, (half,), generator=gen, dtype=torch.uint8)
            pages.view(-1)[:half].copy_(noise.to(pages.device))
        self.scratch_garbage(g, scratch_buf)
