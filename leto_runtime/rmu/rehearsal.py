"""A waiting shadow's rehearsal of the update: one whole RMU step on scratch memory.

Why: a promoted trainer's first `opt.step()` was 2.8x its steady one on the GPU (191 vs 68 ms,
docs/BENCHMARKS.md), almost all of it CPU: CUDA loads a kernel at its first launch (the norm,
float64 square, clamp and reciprocal of the clipping took 5-30 ms each), and the update's
Python paths, the marker's host mirror and the parity codes are made on first use.  All of
that is the same for any state, so a shadow can pay it while it waits.

What: `rehearse(updater)` builds an `Updater` of the same configuration (AdamW settings,
parity backend and geometry, chunking, transactions) over *private* states of a few pages
(`open_states(client=None)`: plain tensors on the same device, the marker in host memory)
and runs `begin`, `step` (gradient protection, norm and clipping, every chunk's transaction
with its markers, write-back and tier 2) and `quiesce` on constant gradients.  It never
touches the retained states, fires no fault point (no `inject`), lends nothing and joins no
process group; the scratch is freed (and on CUDA the allocator's cache given back) before it
returns.  A failure is the caller's to log: the promoted trainer then pays the first use, as
without the rehearsal.

Calling contract: `rehearse(updater) -> float` (seconds), from the thread that will run the
updater, before the shadow's context limits are lowered (`promotion.wait_for_promotion`).
"""
from __future__ import annotations

import time

import torch

from leto_runtime.rmu import adamw as A
from leto_runtime.rmu.states import Geometry, Layout, open_states

SCRATCH_PAGE_BYTES = 64 << 10      # kernels and code paths do not depend on the page size


def scratch_geometry(geo: Geometry) -> Geometry:
    """The retained geometry with pages of at most SCRATCH_PAGE_BYTES: the same parity code
    (data pages, tiers) at a few MiB of scratch instead of tier1 x 12 full pages."""
    return Geometry(geo.data_pages, geo.tier1, geo.tier2, min(geo.page_bytes, SCRATCH_PAGE_BYTES))


def rehearse(updater) -> float:
    from leto_runtime.rmu.updater import Updater
    t0 = time.monotonic()
    ss0 = updater.ss
    geo = scratch_geometry(ss0.geo)
    # Two chunks and a ragged tail: the chunk loop, the commit and the last partial chunk.
    numel = 2 * ss0.chunk_pages * geo.page_bytes // 4 + 3
    layout = Layout.of([("rehearsal", (numel,))], geo.page_bytes)
    ss = open_states(layout, client=None, geo=geo, device=str(ss0.device),
                     chunk_pages=ss0.chunk_pages)
    # A script's own optimizer (a plan of parameter groups) rehearses the AdamW chunk path with
    # its clipping: the groups' own arithmetic is torch's, loaded by any step of theirs.
    cfg = (updater.cfg if updater.plan is None and updater.cfg is not None
           else A.AdamWConfig(lr=1e-3, clip_grad_norm=updater.clip))
    up = Updater(ss, cfg, backend=updater.backend, transactions=updater.transactions,
                 lend=False, drain=False)
    try:
        ss.flat(ss.grads).fill_(1e-3)
        up.begin(0)
        up.step(0, None)
        up.quiesce()
        if up.cuda:
            torch.cuda.current_stream(ss.device).synchronize()
    finally:
        up.close()
        del up, ss
        if torch.device(ss0.device).type == "cuda":
            torch.cuda.empty_cache()
    return time.monotonic() - t0
