"""The folded chunk: the undo copy made inside the update kernel, and how recovery trusts it.

Without folding, a chunk's undo copy is complete before the kernel that overwrites the chunk
starts (the marker's `sub` = 1 + slot says so).  Folded (cuda/adamw_ws.cu, fold with counts),
one kernel reads each state in place once, writes the old values to the undo buffer and the
new ones in place, so at a kill part of the undo buffer is current and part of the chunk is
new.  The kernel leaves the evidence of which parts, per *unit* (a 512-byte column of every
page, one producer warp's share):

    counts[c][u] = (tag << 16) | k      (two copies c, in different pages of the undo state)

means: the undo copy of the first k *stages* of unit u is complete, and no new value of a stage
at or above k has been stored.  Stage s covers the chunk's pages n_pad-1-2s and n_pad-2-2s
(n_pad: the chunk's n pages rounded up to 16; the kernel runs the pages backwards, as the
Horner wants them).  `tag` names the transaction (iteration t and the chunk's index in the
update), so a count left by another chunk reads as k = 0.  A count of *this* transaction left
by an earlier attempt of it (a kill, a restore, the same chunk run again) is still true: the
attempt before wrote the same old values to the undo buffer, and the chunk was restored to
them.

Recovery (`restore_`): where the marker says the chunk is folded in flight (`sub` = FOLD_SUB),
every (page, unit) whose stage is below the unit's count comes back from the undo buffer; the
rest of the chunk is untouched.  A lost undo page makes its chunk page an erasure (decoded from
the authoritative parity buffer, which encodes the chunk's committed values), as does every
page of the chunk when both copies of the counts are lost.

On CPU the chunk runs the same protocol without a kernel: the undo copy, then every unit's
count = all stages, then the update (`count_all_`).  `garbage_` is what a kill inside the
folded kernel can leave, for the fault injection: random counts, the undo copy of the counted
stages, random bytes in the counted stages of the chunk and in the uncounted undo stages.

Calling contract: pure tensor functions over the views `states.StateSet` gives
(`fold_counts`, `undo_pages`, the model pages); none writes the marker.
"""
from __future__ import annotations

import torch

FOLD_SUB = 3            # the marker's `sub`: chunk `chunk` is folded in flight (the counts tell)
UNIT_BYTES = 512        # one producer warp's column of a page (cuda/adamw_ws.cu)
PAGES_PER_STAGE = 2
TAG_BITS = 48


class FoldError(RuntimeError):
    """The fold's evidence cannot be read as the protocol defines it."""


def units(page_bytes: int) -> int:
    """Count words per copy: the kernel's grid of 2 KiB tiles, 4 producer warps each."""
    return (page_bytes // 1024 + 1) // 2 * 4


def tag(t: int, index: int, chunks: int) -> int:
    """The transaction of chunk `index` of the `chunks` of iteration t's update: consecutive
    transactions differ, whatever the model's size (never 0 below 2^48 transactions)."""
    if not 0 <= index < chunks:
        raise FoldError(f"chunk index {index} is outside the update's {chunks} chunks")
    return ((t + 1) * chunks + index) % (1 << TAG_BITS)


def n_stages(n: int) -> int:
    return ((n + 15) & ~15) // PAGES_PER_STAGE


def stage_of_pages(n: int) -> torch.Tensor:
    """(n,) int64: the stage in which the kernel handles each of the chunk's n pages."""
    n_pad = (n + 15) & ~15
    return (n_pad - 1 - torch.arange(n, dtype=torch.int64)) // PAGES_PER_STAGE


def read_counts(copies: list[torch.Tensor | None], tg: int, n: int) -> torch.Tensor | None:
    """(units,) int64 on the CPU: each unit's count of transaction `tg` (0 where a word names
    another one), from the first readable copy (None: a copy lost); None when both are lost.
    A word of this transaction with a count above the chunk's stages is not the kernel's:
    FoldError."""
    for c in copies:
        if c is None:
            continue
        w = c.detach().to("cpu", torch.int64)
        mine = (w >> 16) == tg
        k = torch.where(mine, w & 0xFFFF, torch.zeros_like(w))
        if int(k.max()) > n_stages(n):
            raise FoldError(f"a fold count of transaction {tg} says {int(k.max())} stages, the chunk "
                            f"has {n_stages(n)}: the counts are not the kernel's")
        return k
    return None


def restore_mask(counts: torch.Tensor, n: int, page_bytes: int) -> torch.Tensor:
    """(n, units) bool: the (page, unit) pairs whose undo copy is current (stage < count)."""
    u = units(page_bytes)
    return stage_of_pages(n)[:, None] < counts[None, :u]


def restore_(chunk_pages: torch.Tensor, undo_pages: torch.Tensor, mask: torch.Tensor,
             keep: list[int] = ()) -> int:
    """chunk_pages (n, S) uint8 <- undo_pages where `mask` (n, units) says so, except pages
    in `keep` (erasures: decoded later).  Page by page, so that the temporary memory is at most
    one page (a promoted trainer's device may be nearly full).  Returns the pages touched."""
    n, S = chunk_pages.shape
    if S % UNIT_BYTES:
        raise FoldError(f"{S}-byte pages are not whole {UNIT_BYTES}-byte units")
    rows = mask[:, :S // UNIT_BYTES].cpu()
    touched = 0
    for p in range(n):
        if p in keep or not bool(rows[p].any()):
            continue
        touched += 1
        if bool(rows[p].all()):
            chunk_pages[p].copy_(undo_pages[p])
            continue
        sel = rows[p].to(chunk_pages.device)
        c, u = chunk_pages[p].view(-1, UNIT_BYTES), undo_pages[p].view(-1, UNIT_BYTES)
        c[sel] = u[sel]
    return touched


def count_all_(copies: list[torch.Tensor], tg: int, n: int) -> None:
    """CPU: every unit's count = all stages (the undo copy is complete and nothing is new)."""
    for c in copies:
        c.fill_((tg << 16) | n_stages(n))


def garbage_(chunk: list[torch.Tensor], undo: list[torch.Tensor], copies: list[torch.Tensor],
             tg: int, gen: torch.Generator) -> None:
    """What a kill inside the folded kernel can leave, stage by stage as the kernel orders its
    stores (each a (n, S) uint8 view): per unit a random count k, or no count of this
    transaction (a word of the one before: as k = 0); stages below k: undo copy made, chunk
    bytes random (new, or torn); stages at or above k: undo bytes random (torn, or the previous
    chunk's), chunk untouched."""
    n, S = chunk[0].shape
    u = units(S)
    n_pad = (n + 15) & ~15
    s0 = (n_pad - n) // PAGES_PER_STAGE          # the first stage with a page of the chunk
    k = torch.randint(s0, n_stages(n) + 1, (u,), generator=gen)
    counted = torch.rand(u, generator=gen) < 0.9
    k_eff = torch.where(counted, k, torch.zeros_like(k))
    # In an order whose every prefix is also a state the kernel can leave (a test's page loss
    # may stop it half-way): undo copies, then the counts, then the torn chunk bytes.
    stages = [(s, [p for p in (n_pad - 1 - 2 * s, n_pad - 2 - 2 * s) if p < n],
               (s < k_eff).repeat_interleave(UNIT_BYTES)[:S].to(chunk[0].device)) for s in range(n_stages(n))]
    for _, pages, done in stages:
        for c, d in zip(chunk, undo):
            for p in pages:
                noise = torch.randint(0, 256, (S,), generator=gen, dtype=torch.uint8).to(c.device)
                d[p].copy_(torch.where(done, c[p], noise))
    before = (tg - 1) % (1 << TAG_BITS)
    words = torch.where(counted, (tg << 16) | k, (before << 16) | k)
    for c in copies:
        c.copy_(words.to(c.device))
    for _, pages, done in stages:
        for c in chunk:
            for p in pages:
                noise = torch.randint(0, 256, (S,), generator=gen, dtype=torch.uint8).to(c.device)
                c[p].copy_(torch.where(done, noise, c[p]))
