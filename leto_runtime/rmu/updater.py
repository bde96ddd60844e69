"""The Resumable Model Updater: one training iteration's update as chunk-level transactions.

Pseudocode 1 of the paper, per rank, over the states of `states.StateSet`:

    protect_grads(t)   R <- RS(G) for every group (gradients already all-reduced)   marker PROTECTED
    synchronize(t)     global all-reduce of the gradient norm -> clip coefficient    marker SYNCED
    update(t)          for each group g:
                         Q <- H1(g)                                   (LOAD)         marker CHUNKS
                         for each chunk j:  U_s <- C_j  (slot s alternates, or 0)  marker sub=1+s
                                            C_j <- AdamW(C_j, G_j)
                                            Q' <- Q xor RS_j(U xor C_j)
                                            commit: marker chunk=j+1, auth=Q'; swap(Q, Q')
                         H1(g) <- Q                                   (WRITEBACK)
                         H2(g) <- RS2(H1(g))                          (TIER2)
                         [default (LETO_RMU_WB_OVERLAP=0: in line): marker group=g+1, wb=g; the two lines
                          above run beside g+1's work; a later marker write drops wb]
                       marker DONE

C_j stands for chunk j of params, exp_avg and exp_avg_sq together (one transaction), Q/Q' for
their three pairs of parity buffers.  The marker is written after each operation has finished
(on GPU after the stream reached it), so it never claims work that is not done.  Folded
(LETO_RMU_FOLD=1): marker sub=3, then U, C_j and Q' in one kernel with stage counts (fold.py).

`transactions=False` is the ablation of the paper's Fig. 12: no undo copy and no per-chunk
parity commit (parity re-encoded at the end of the group), so a crash inside the update leaves
state that can only be updated a second time: the run diverges (exactness is the transactions').

`inject(point, **where)` is called before each operation (`contract.INJECT_POINTS`).
`where` carries `step`, `group`, `chunk` and `garbage`: a callable that leaves what a kill in
the middle of a kernel can (chunk and scratch parity torn; folded: fold.garbage_).

Activation lending (paper §5.3, `lend.py`): on CUDA U and Q are lent to the caching allocator
for activations between `begin(t)` (after the COMPUTE marker) and `protect_grads(t)`, which
ends it and checks that no tensor created meanwhile is still alive there (`lend.LendingError`);
U/Q contents matter only while the marker says UPDATING.  `lend=False` (LETO_LEND=0): off.

The work is split three ways (same transactions, same bits on every path).  This module orders
each iteration: the operations, the marker writes that claim them, the injection points.
`chunk_ops.ChunkOps` is a chunk's data path (undo copy, AdamW, parity delta; the folded chunk,
`fold.py`, with LETO_RMU_FOLD=1); `side_stream.SideStream` runs the next group's parity load and
the overlapped write-back beside the current stream (CUDA).  `profile = {}` makes every `lap()`
synchronize and charge the time to a phase (benchmarks).

Marker writes on CUDA are stream-ordered (`Marker.write_async`; by default a one-block kernel,
cuda/marker_kernel.cu): each is queued right behind the operation it claims and before the one
it guards, so the GPU runs the operations back to back; the host stays at most
LETO_RMU_LOOKAHEAD chunks ahead of the GPU (`lookahead.py`).  The update settles before it
returns, and the fault injection settles before it fires (`leto_runtime.faults`).  On CPU, or
with LETO_RMU_STREAM_MARKER=0, every marker write is "fence, then host store".
LETO_RMU_UNDO_PIPELINE=1: two undo slots (chunk_ops.py; off by default, measured no faster).

Calling contract: `Updater(states, cfg)`; per iteration `begin(t)`, then `protect_grads(t)`,
`synchronize(t, pg)` and `update(t)` in that order (`step(t, pg)` does all three); `close()`
ends lending.  `resume(t)` continues an
interrupted update from the marker (the caller has repaired the state first: recovery.py).
"""
from __future__ import annotations

import time

import torch

from leto_runtime.wire import settings
from leto_runtime.rmu import adamw as A
from leto_runtime.rmu import fold as FD
from leto_runtime.rmu.chunk_ops import ChunkOps
from leto_runtime.rmu.lookahead import Lookahead
from leto_runtime.rmu.marker import GState, Marker, Phase, Record
from leto_runtime.rmu.side_stream import SideStream
from leto_runtime.rmu.states import StateSet


def _noinject(point: str, **where) -> None:
    return None


class Updater:
    def __init__(self, ss: StateSet, cfg: "A.AdamWConfig | None", *, inject=None,
                 backend: str = "auto", transactions: bool = True, lend: bool | None = None,
                 plan=None, drain: bool = True):
        from leto_runtime.parity import ParityCode

        self.ss, self.cfg, self.backend, self.transactions = ss, cfg, backend, transactions
        # `plan` (rmu/plan.py): parameter groups with their own values (fused.for_group per
        # group, else torch ops); without one, `cfg`'s AdamW over every parameter.
        self.plan = plan
        self.clip = plan.clip if plan is not None else cfg.clip_grad_norm
        self.inject = inject or _noinject
        if torch.device(ss.device).type == "cpu":
            A.warm_cpu_math()       # before the first real update of this process (adamw.py)
        self.marker = Marker(ss.marker, backend=backend)
        g = ss.geo
        self._codes: dict[int, ParityCode] = {}
        self._ParityCode = ParityCode
        self.t2 = ParityCode(g.tier1, g.tier2, g.page_bytes, backend=backend) if g.tier2 else None
        self.gflat = ss.flat(ss.grads)
        self.cuda = str(ss.device).startswith("cuda")
        from leto_runtime.rmu import lend as L
        self.lend_on = self.cuda and (L.wanted(ss.device) if lend is None else bool(lend))
        self.lender = None
        self.lend_hold: str | None = None
        # CUDA: the fused AdamW kernel (fused.py; None: off, or failed its self-check here) ...
        from leto_runtime.rmu.fused import Fused
        self.fused = (Fused.for_device(ss.device, cfg) if self.cuda and transactions
                      and plan is None else None)
        # ... and, where enabled and checked, AdamW and the parity delta in one kernel that reads
        # the undo copy (fused.chunk_syndrome_; off with LETO_RMU_FUSED_SYNDROME=0).
        self.fused_syndrome = self.fused is not None and self.fused.syndrome_ok(ss.device, ss.geo.tier1)
        # Phase breakdown for benchmarks (a dict turns it on; every lap then synchronizes).
        self.profile: dict | None = None
        self._lap_t = 0.0
        # CUDA: the next group's parity load and the overlapped write-back on a side stream.
        self.side = SideStream(ss, self.cuda)
        # CUDA: marker writes queued in stream order instead of "fence, then host store".
        # LETO_RMU_STREAM_MARKER: kernel (default: device-side stores), 1 / hostfunc, 0 (fences).
        knobs = settings.get()
        smode = knobs.rmu_stream_marker
        self.streamed = (self.cuda and transactions and smode != "0"
                         and self.marker.use_stream(ss.device, "hostfunc" if smode in ("1", "hostfunc")
                                                    else "kernel"))
        # Undo slots (LETO_RMU_UNDO_PIPELINE=1): chunk j+1's undo copy beside chunk j's kernel.
        piped = knobs.rmu_undo_pipeline
        self.slots = 2 if transactions and piped and (self.fused_syndrome or not self.cuda) else 1
        # The folded chunk (LETO_RMU_FOLD=1; fold.py): the undo copy made inside the chunk's
        # kernel, which leaves per-unit stage counts for recovery (CUDA: where that kernel passed
        # its check, fused.fold_ok; CPU: the same protocol, the copy first).  One undo slot.
        self.fold = transactions and knobs.rmu_fold and self.slots == 1 and g.page_bytes % 1024 == 0 and (
            not self.cuda or (self.fused_syndrome and self.fused.fold_ok(ss.device, ss.geo.tier1)))
        # Write-back overlap (default; LETO_RMU_WB_OVERLAP=0: off): group g's write-back and
        # tier-2 refresh queued on the side stream while the marker moves on to g+1 and names g
        # in `wb` (the next marker write that drops it waits for them; recovery finishes it).
        self.wb_overlap = transactions and knobs.rmu_wb_overlap
        # A chunk's undo copy, AdamW and parity delta; `_chunk` makes them a transaction.
        self.chunks = ChunkOps(ss, cfg, gflat=self.gflat, code=self.code, fence=self.fence,
                               transactions=transactions, fused=self.fused,
                               one_kernel=self.fused_syndrome, slots=self.slots, plan=plan,
                               group_kernel=self._group_kernel() if plan is not None else None)
        from leto_runtime import drain as D     # CUDA: promotion without the exit fence
        self.drain = D.for_device(ss.device) if self.cuda and drain else D.OFF
        self.ahead = Lookahead(knobs.rmu_lookahead if self.streamed else 0, self._drain_close,
                               self.drain.open, self.inject)

    def _group_kernel(self):
        """With a plan on CUDA with transactions: hyper -> its checked fused kernel or None."""
        from leto_runtime.rmu import fused as F
        if not (self.cuda and self.transactions and F.wanted()):
            return None
        return lambda h: F.for_group(self.ss.device, h, self.clip)

    # ---- helpers -------------------------------------------------------------------------
    def lap(self, name: str) -> None:
        """Profiling only: charge the time since the previous lap to `name`."""
        if self.profile is None:
            return
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        now = time.perf_counter()
        if self._lap_t:
            self.profile[name] = self.profile.get(name, 0.0) + (now - self._lap_t) * 1e3
        self._lap_t = now

    def code(self, k: int):
        c = self._codes.get(k)
        if c is None:
            c = self._codes[k] = self._ParityCode(k, self.ss.geo.tier1, self.ss.geo.page_bytes,
                                                  backend=self.backend)
        return c

    def fence(self) -> None:
        """Everything queued so far has happened (before a marker write claims it)."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def _drain_close(self) -> None:      # before the host waits: what was queued is covered
        if self.drain.on:
            self.drain.close((torch.cuda.current_stream(self.ss.device), self.side.stream,
                              self.chunks.undo_stream))

    def _mark(self, **changes):
        """Marker write claiming everything queued so far: queued in stream order on CUDA
        (Marker.write_async), else after a fence."""
        if self.streamed:
            return self.marker.write_async(**changes)
        self.fence()
        return self.marker.write(**changes)

    def _encode_into_host(self, st, g: int) -> None:
        """Full encode of group g of `st` into its host tier-1 and tier-2 parity."""
        gi = st.groups[g]
        data = st.group_pages(g)
        p1h, p2h = st.tier1(g), st.tier2(g)
        if data.device.type == "cpu":
            self.code(gi.k).encode(data, out=p1h)
            if self.t2 is not None:
                self.t2.encode(p1h, out=p2h)
            return
        p1 = self.code(gi.k).encode(data)
        p1h.copy_(p1, non_blocking=self.streamed)
        if self.t2 is not None:
            p2h.copy_(self.t2.encode(p1), non_blocking=self.streamed)

    def encode_all(self, states) -> None:
        for st in states:
            for g in range(len(st.groups)):
                self._encode_into_host(st, g)
        self.fence()

    def _tier2_from(self, st, g: int, q: torch.Tensor) -> None:
        if self.t2 is None:
            return
        p2h = st.tier2(g)
        if q.device.type == "cpu":
            self.t2.encode(st.tier1(g), out=p2h)
        else:
            p2h.copy_(self.t2.encode(q), non_blocking=self.streamed)

    # ---- the iteration -------------------------------------------------------------------
    def quiesce(self) -> None:
        """Side-stream copies into U/Q that no update consumed (one that did not run: a peer
        failed first) and a queued write-back end before anything queued from here on, so U/Q
        are free and the host parity final (a step boundary: `guard.Guard`)."""
        self.chunks.quiesce()
        self.side.quiesce()

    def begin(self, t: int) -> None:
        self.quiesce()           # activations included: nothing queued from here on races them
        # The marker says COMPUTE before any activation can land in U/Q (lend.py).
        self.marker.write(t=t, phase=Phase.COMPUTE, group=0, chunk=0, sub=0, auth=0,
                          gstate=GState.LOAD, wb=-1, wb_auth=0)
        if self.lend_on and self.lend_hold is None:
            self.prepare_lending()
            self.lender.enter(t)

    def hold_lending(self, why: str | None) -> None:
        """Lend nothing from the next `begin` on while `why` holds (None: lend again): a library
        is about to allocate memory that outlives the iteration (DDP's bucket rebuild)."""
        self.lend_hold = why

    def prepare_lending(self) -> None:
        """Create the lending pool now (its library, its regions, cuBLAS workspaces: ~0.3 s in
        a fresh CUDA process) rather than at the first `begin()`: a shadow calls it while it
        waits, so a promotion does not pay it.  Writes nothing into U/Q.  No-op where lending
        is off or the pool exists."""
        if self.lend_on and self.lender is None:
            from leto_runtime.rmu.lend import Lender
            self.lender = Lender(self.ss.lend_ranges(), self.ss.device)

    def end_lending(self, t: int) -> None:
        """Stop lending U/Q; raises lend.LendingError if a live tensor is still in them."""
        if self.lender is not None:
            self.lender.leave(t)

    def close(self) -> None:
        self.chunks.close()
        if self.lender is not None:
            self.lender.close()
            self.lender = None

    def protect_grads(self, t: int) -> None:
        self._lap_t = 0.0          # profiling: the update phase starts here
        self.lap("")
        self.end_lending(t)
        self.lap("lending check")
        # U/Q are RMU's again: group 0's parity load and chunk 0's undo copy start now, on
        # their side streams, beside the gradients' encode (nothing reads them before the
        # marker says so, and the update of t-1 left both sources final).
        self.side.prefetch(t, 0)
        self.chunks.queue_undo(t, 0, 0)
        self.inject("grads.protect", step=t)
        for g in range(len(self.ss.grads.groups)):
            self._encode_into_host(self.ss.grads, g)
        self.lap("gradient parity")
        self._mark(t=t, phase=Phase.PROTECTED)
        self.lap("markers")

    def local_norm(self) -> torch.Tensor:
        """This rank's gradient norm (pure data parallelism: every rank holds the full,
        all-reduced gradients, so it is the global norm)."""
        return A.total_norm_from_sq(A.grad_sq_norm(self.param_grads()))

    def param_grads(self) -> list[torch.Tensor]:
        """The gradients the clipping norm is over: every trainable parameter's, in
        `param_groups` order with a plan (frozen ones have none)."""
        slots = self.plan.norm_slots if self.plan is not None else self.ss.layout.params
        return [self.gflat[p.offset:p.offset + p.numel] for p in slots]

    def synchronize(self, t: int, pg=None) -> torch.Tensor:
        """The global synchronization: entered only after the gradients are protected, so a
        rank past it proves that every rank's gradients of t are recoverable (docs/RMU.md, "One
        iteration")."""
        self.inject("sync", step=t)
        if self.clip is not None:
            norm = self.local_norm().to(torch.float32).reshape(1).clone()
        else:
            norm = torch.zeros(1, dtype=torch.float32, device=self.gflat.device)
        # The host waits (barrier, coefficient): drain-covered; meanwhile only norm/coef are written
        self._drain_close()
        if pg is not None:
            import torch.distributed as dist
            # The barrier is entered only with the gradients protected and PROTECTED in memory
            # (a peer past it may finish the update from this rank's gradient parity).
            self.marker.settle()
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pg)
        coef = (A.clip_coef(norm[0], self.clip)
                if self.clip is not None else torch.ones((), dtype=torch.float32))
        bits = Record.bits(coef)
        self.drain.open()
        self.lap("global sync")
        self._mark(t=t, phase=Phase.SYNCED, coef_bits=bits, coef_t=t)
        self.inject("sync.after", step=t)
        self.lap("markers")
        return coef

    def step(self, t: int, pg=None) -> None:
        self.drain.begin()
        try:
            self.protect_grads(t)
            self.synchronize(t, pg)
            self.update(t)
        finally:
            self.drain.end()            # the script launches next: nothing of it is covered

    def update(self, t: int) -> None:
        self.end_lending(t)
        self._mark(t=t, phase=Phase.UPDATING, group=0, chunk=0, sub=0, auth=0, gstate=GState.LOAD)
        self._run(t, start_group=0)

    def resume(self, t: int, coef_bits: int) -> None:
        """Finish the update of t from the marker (state repaired by recovery.py first)."""
        rec = self.marker.rec
        if rec.done_step >= t:
            return
        self.end_lending(t)
        if rec.t != t or rec.phase < Phase.PROTECTED:
            raise RuntimeError(f"cannot finish iteration {t} from marker {rec.describe()}")
        if rec.phase < Phase.UPDATING:
            self.marker.write(t=t, phase=Phase.UPDATING, group=0, chunk=0, sub=0, auth=0,
                              gstate=GState.LOAD, coef_bits=coef_bits, coef_t=t)
        elif not self.transactions:
            # Ablation: no undo copy and no chunk progress to resume from; all that is left
            # is to update the group again from its start (chunks already updated get a
            # second update -- the divergence the transactions prevent).
            self.marker.write(chunk=0, sub=0, gstate=GState.CHUNKS)
        rec = self.marker.rec
        if rec.phase == Phase.UPDATING and rec.wb >= 0:
            # A write-back that may not have finished (recovery.repair left its buffer
            # authoritative): do it again, then drop it from the marker.
            self._writeback(t, rec.wb, rec.wb_auth, side=False)
            self._mark(wb=-1, wb_auth=0)          # claims the copies just queued
        self._run(t, start_group=self.marker.rec.group)

    def _run(self, t: int, start_group: int) -> None:
        self.chunks.check()
        self.ahead.clear()
        coef = torch.tensor(self.marker.rec.coef, dtype=torch.float32, device=self.gflat.device)
        lr = A.lr_at(self.cfg, t) if self.plan is None else None      # a plan: per group
        for g in range(start_group, len(self.ss.model[0].groups)):
            self._group(t, g, coef, lr)
        self.inject("rmu.done", step=t)
        self.side.finish_writeback()
        self._mark(phase=Phase.DONE, group=0, chunk=0, sub=0, auth=0, gstate=GState.LOAD, wb=-1,
                   wb_auth=0)
        self._drain_close()
        self.inject("rmu.settle", step=t)
        self.marker.settle()            # the update is over when the GPU and the marker say so
        self.drain.open()
        self.lap("markers")

    def _group(self, t: int, g: int, coef: torch.Tensor, lr: float) -> None:
        ss, m = self.ss, self.marker
        rec = m.rec
        if rec.group != g:
            rec = self._mark(group=g, chunk=0, sub=0, auth=0, gstate=GState.LOAD)
        if rec.gstate == GState.LOAD:
            self.inject("rmu.load", step=t, group=g)
            if not self.side.take_prefetch(t, g):
                for i, st in enumerate(ss.model):
                    ss.q(i, 0, g).copy_(st.tier1(g), non_blocking=self.streamed)
            self.lap("parity load/write-back")
            rec = self._mark(gstate=GState.CHUNKS, chunk=0, sub=0, auth=0)
            self.lap("markers")
        if rec.gstate == GState.CHUNKS:
            # While the marker names g-1's write-back, its buffers are authoritative; g+1's
            # prefetch reuses them, so it waits until the marker stops naming it (first chunk).
            late = self.wb_overlap and m.rec.wb >= 0
            if not late:
                self.side.prefetch(t, g + 1)
            chunks = ss.chunks(g)
            for j in range(rec.chunk, len(chunks)):
                self._chunk(t, g, j, chunks[j], coef, lr)
                self.ahead.queued(t, g, j)
                if late:
                    self._drop_writeback(t, g)
                    late = False
            if late:
                self._drop_writeback(t, g)
            if not self.transactions:        # ablation: parity re-encoded after the fact
                for i, st in enumerate(ss.model):
                    q = ss.q(i, m.rec.auth, g)
                    q.copy_(self.code(st.groups[g].k).encode(st.group_pages(g)))
            if self.wb_overlap:         # the marker moves on to g+1 naming g's write-back
                self.side.finish_writeback()
                rec = self._mark(group=g + 1, chunk=0, sub=0, auth=0, gstate=GState.LOAD, wb=g,
                                 wb_auth=m.rec.auth)
                self.lap("markers")
                self._writeback(t, g, rec.wb_auth, side=True)
                self.lap("parity load/write-back")
                return
            rec = self._mark(gstate=GState.WRITEBACK)
        if rec.gstate == GState.WRITEBACK:
            self.inject("rmu.writeback", step=t, group=g)
            for i, st in enumerate(ss.model):
                st.tier1(g).copy_(ss.q(i, rec.auth, g), non_blocking=self.streamed)
            self.lap("parity load/write-back")
            rec = self._mark(gstate=GState.TIER2)
            self.lap("markers")
        if rec.gstate == GState.TIER2:
            self.inject("rmu.tier2", step=t, group=g)
            for i, st in enumerate(ss.model):
                self._tier2_from(st, g, ss.q(i, rec.auth, g))
            self.lap("tier-2 parity")
            self._mark(group=g + 1, chunk=0, sub=0, auth=0, gstate=GState.LOAD)
            self.lap("markers")

    def _writeback(self, t: int, g: int, auth: int, side: bool) -> None:
        """Group g's host tier-1 parity <- its buffer `auth`, then its tier 2.  `side`: on the
        side stream (CUDA) after everything queued so far (SideStream.finish_writeback waits)."""
        ss = self.ss
        with self.side.writeback(side) as stream:
            self.inject("rmu.writeback", step=t, group=g)
            for i, st in enumerate(ss.model):
                st.tier1(g).copy_(ss.q(i, auth, g), non_blocking=self.streamed)
            if stream is None:          # (a lap would synchronize the side stream)
                self.lap("parity load/write-back")
            self.inject("rmu.tier2", step=t, group=g)
            for i, st in enumerate(ss.model):
                self._tier2_from(st, g, ss.q(i, auth, g))
            if stream is None:
                self.lap("tier-2 parity")

    def _drop_writeback(self, t: int, g: int) -> None:
        """The previous group's write-back is over (waited for) and the marker says so; then
        group g+1's prefetch may use that group's buffers."""
        self.inject("rmu.writeback.drop", step=t, group=self.marker.rec.wb)
        self.side.finish_writeback()
        self._mark(wb=-1, wb_auth=0)
        self.side.prefetch(t, g + 1)

    def _chunk(self, t: int, g: int, j: int, chunk: tuple[int, int], coef, lr: float) -> None:
        """Chunk j of group g as a transaction: `ChunkOps`'s steps, each claimed by a marker
        write once done, each preceded by its injection point."""
        ops, m = self.chunks, self.marker
        first, count = chunk
        views, grad = ops.operands(g, chunk)
        where = dict(step=t, group=g, chunk=j)
        if self.fold:
            return self._fold_chunk(t, g, j, chunk, views, grad, coef, lr)
        if self.transactions:
            self.inject("rmu.undo", **where)
            ops.undo(t, g, j)
            self.lap("undo copy")
            self._mark(chunk=j, sub=1 + ops.slot(g, j))
            self.lap("markers")
            ops.queue_undo(t, g, j + 1)       # runs beside this chunk's kernel
        auth = m.rec.auth
        self.inject("rmu.update", garbage=lambda: ops.garbage(g, first, count, 1 - auth), **where)
        if self.fused_syndrome:
            ops.update_with_delta(t, g, j, chunk, views, grad, coef, lr, auth)
            self.lap("adamw + chunk parity delta")
            self.inject("rmu.delta", garbage=lambda: ops.garbage(g, first, count, 1 - auth), **where)
            self.inject("rmu.commit", **where)
            self._mark(chunk=j + 1, sub=0, auth=1 - auth)
            self.lap("markers")
            return
        deltas = ops.update(t, g, chunk, views, grad, coef, lr)
        self.lap("adamw")
        if not self.transactions:
            return          # ablation: no commit, so no chunk progress either
        self.inject("rmu.delta", garbage=lambda: ops.garbage(g, first, count, 1 - auth), **where)
        ops.parity_delta(g, j, chunk, auth, deltas)
        self.inject("rmu.commit", **where)
        self.lap("chunk parity delta")
        self._mark(chunk=j + 1, sub=0, auth=1 - auth)
        self.lap("markers")

    def _fold_chunk(self, t: int, g: int, j: int, chunk: tuple[int, int], views, grad, coef, lr) -> None:
        """Chunk j of group g folded (fold.py): the marker says so before the kernel writes;
        its counts tell recovery what to restore until the commit."""
        ops, where = self.chunks, dict(step=t, group=g, chunk=j)
        self.inject("rmu.undo", **where)
        auth = self._mark(chunk=j, sub=FD.FOLD_SUB).auth
        self.lap("markers")
        self.inject("rmu.update", garbage=lambda: ops.fold_garbage(t, g, j, chunk, 1 - auth), **where)
        ops.fold_update(t, g, j, chunk, views, grad, coef, lr, auth, kernel=self.cuda)
        self.lap("adamw + chunk parity delta")
        # after the kernel only the commit is left: a kill leaves the scratch parity torn at most
        self.inject("rmu.delta", garbage=lambda: ops.scratch_garbage(g, 1 - auth), **where)
        self.inject("rmu.commit", **where)
        self._mark(chunk=j + 1, sub=0, auth=1 - auth)
        self.lap("markers")
