"""Background scrub of the retained model state: parity syndromes over a budgeted slice per step.

Role: find a silently flipped bit or a stale parity row before a failure needs that parity.
At each step boundary (`guard.Guard.at_boundary`, where every group's data and host parity
agree) `Scrubber.run` checks one slice: bytes [a, a + L) of every page of one protection group
of one model state (params, exp_avg, exp_avg_sq), tier 1 (data + tier-1 rows) and tier 2
(tier-1 + tier-2 rows).  The bitsliced code (docs/PARITY.md) makes any 1 KiB-aligned byte window of
a group's pages a set of codewords of its own, so a slice is checked exactly as a whole group.
Slices advance round robin over windows, groups and states; `passes` counts full sweeps.

Budget: `budget` is the share of the step time the scrub may take (0.002: steps grow <= 0.2%).
Each boundary earns `budget` x the time since the previous one as credit (an interval longer
than 4x the running mean -- an evaluation, a checkpoint -- counts as 4x the mean); a slice runs
when the credit covers what the last slice cost, and its measured cost is spent.  The slice width L
follows the credit (within [1 KiB, page], at most x2 per slice): wide slices on long steps, and
on short ones a narrow slice every few steps -- on average never more than the budget.

Findings (all syndromes zero means consistent): a mismatch is re-checked over the whole group
with location (Berlekamp-Massey, `ParityCode.scrub`), then `verdict` decides:
* only parity rows located (tier 1 rows, or tier 2 over consistent tier 1): re-encode the
  group's parity from its data (tier 1 from data, tier 2 from tier 1) -- repaired;
* a data page located, or nothing that explains the syndromes: the state cannot be trusted
  (a corrupted value may already have been used by the training) -- `Unrecoverable`.
Every finding goes to `report(kind, **fields)` (the event log: `scrub` phases).

Calling contract: `run(t)` only at a step boundary, with the updater quiesced (`Updater.quiesce`)
and the parity buffers (`StateSet.qbuf`) free: on CUDA they stage the host rows and hold the
syndromes.  It synchronizes the device when it has checked a slice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from leto_runtime.rmp.reconstruct import GroupLoss, ReconstructReport, Unrecoverable

BLOCK = 1024            # bitsliced block: the smallest self-contained byte window
CREDIT_CAP = 1.0        # seconds: credit saved up over long steps is spent in slices, not hoarded


@dataclass(frozen=True)
class Verdict:
    action: str          # ok | reencode | unrecoverable
    reason: str


def verdict(t1, t2, k: int) -> Verdict:
    """What to do with a group whose full scrub gave `t1` (data + tier-1 rows; positions
    0..k-1 data, k.. parity) and `t2` (tier-1 + tier-2 rows, or None without tier 2):
    `parity.code.ScrubReport`s.  Pure."""
    if t1.consistent and (t2 is None or t2.consistent):
        return Verdict("ok", "every syndrome is zero over the whole group")
    if not t1.consistent:
        data = sorted(j for j in t1.suspects if j < k)
        if data:
            return Verdict("unrecoverable", f"data page(s) {data} of the group do not match "
                           "their parity: the training may already have used corrupted values")
        if t1.unlocated or not t1.suspects:
            return Verdict("unrecoverable", f"{t1.bad_symbols} symbol(s) do not match the "
                           "parity and the mismatch cannot be located (more corrupted pages "
                           "than the code can locate, or one tier-1 row): data and parity "
                           "cannot both be trusted")
        rows = sorted(j - k for j in t1.suspects)
        return Verdict("reencode", f"tier-1 parity row(s) {rows} are stale or corrupted; the "
                       "data is consistent with the other rows: re-encoded from the data")
    return Verdict("reencode", "tier-2 parity does not match tier 1 (tier 1 matches the data): "
                   "re-encoded from tier 1")


@dataclass
class Stats:
    slices: int = 0
    bytes: int = 0
    seconds: float = 0.0
    passes: int = 0
    repaired: int = 0


class Scrubber:
    def __init__(self, ss, updater, budget: float, report=None, clock=time.perf_counter):
        self.ss, self.up, self.budget = ss, updater, float(budget)
        self.report = report or (lambda kind, **f: None)
        self.clock = clock
        self.S = ss.geo.page_bytes
        self.width = BLOCK
        self.cursor = (0, 0, 0)            # (model state, group, byte offset)
        self.stats = Stats()
        self._last = None                  # clock at the previous boundary
        self._credit = 0.0                 # seconds of scrub the budget has paid for
        self._cost = 1e-3                  # what the last slice cost (before the first: a guess,
                                           # so the budget pays for that one too)
        self._earned = 0.0                 # credit of the last interval
        self._gap: float | None = None     # running mean of the interval between boundaries
        self._bases: dict = {}             # (state, group) -> address arrays at offset 0
        self._windows: dict = {}           # m -> the syndrome kernel's coefficient window
        self.cuda = str(ss.device).startswith("cuda")
        from leto_runtime.parity import backends
        self._be = backends.cuda_backend() if self.cuda else backends.cpu_backend()

    # ---- budget ----------------------------------------------------------------------------
    def _earn(self, now: float) -> bool:
        """Add this interval's credit; True when it pays for the next slice."""
        last, self._last = self._last, now
        if last is None or self.budget <= 0:
            return False
        gap = now - last
        # A pause between steps (evaluation, a checkpoint save) earns no more than a few
        # steps' credit: the next step must not pay a long scrub for it.
        self._gap = gap if self._gap is None else 0.9 * self._gap + 0.1 * min(gap, 4 * self._gap)
        self._earned = self.budget * min(gap, 4 * self._gap)
        self._credit = min(self._credit + self._earned, CREDIT_CAP)
        return self._credit >= self._cost

    def _resize(self, cost: float) -> None:
        """Next width: one slice per step's credit at this slice's cost per byte."""
        want = self.width * min(2.0, max(0.5, self._earned / max(cost, 1e-9)))
        self.width = int(max(BLOCK, min(self.S, want // BLOCK * BLOCK)))

    def run(self, t: int) -> None:
        """Check slices while the credit pays for them, up to the end of the current pass."""
        if not self._earn(self.clock()) or not self.ss.model[0].groups:
            return
        passes = self.stats.passes
        while True:
            self._one(t)
            if self.stats.passes != passes or self._credit < self._cost:
                return

    def _one(self, t: int) -> None:
        t0 = self.clock()
        i, g, a = self.cursor
        L = min(self.width, self.S - a)
        if not self._slice_ok(i, g, a, L):
            self._full_check(t, i, g)
        cost = self.clock() - t0
        self._credit -= cost
        self._cost = cost
        st = self.stats
        st.slices += 1
        st.bytes += L * (self.ss.model[i].groups[g].k + self.ss.geo.tier1 + self.ss.geo.tier2)
        st.seconds += cost
        self._advance(L)
        self._resize(cost)
        self._last += cost                 # the next interval excludes this slice's cost

    def _advance(self, L: int) -> None:
        i, g, a = self.cursor
        a += L
        if a >= self.S:
            a, g = 0, g + 1
            if g >= len(self.ss.model[i].groups):
                g, i = 0, i + 1
                if i >= len(self.ss.model):
                    i = 0
                    self.stats.passes += 1
        self.cursor = (i, g, a)

    # ---- one slice -------------------------------------------------------------------------
    def _ptrs(self, base: int, n: int, stride: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64) * stride + base

    def _dev(self, p: torch.Tensor) -> torch.Tensor:
        return p.to(self.ss.device, non_blocking=True) if self.cuda else p

    def _group_ptrs(self, i: int, g: int) -> tuple:
        """Addresses of group g of model state i at offset 0: data pages, tier-1 rows, tier-2
        rows (views are not kept: a mapping that moved is looked up again)."""
        st = self.ss.model[i]
        S = self.S
        key = (i, g, st.group_pages(g).data_ptr(), st.tier1(g).data_ptr())
        hit = self._bases.get((i, g))
        if hit is None or hit[0] != key:
            p2 = st.tier2(g)
            hit = (key, self._ptrs(key[2], st.groups[g].k, S), self._ptrs(key[3], self.ss.geo.tier1, S),
                   self._ptrs(p2.data_ptr(), self.ss.geo.tier2, S) if p2 is not None else None)
            self._bases[(i, g)] = hit
        return hit[1:]

    def _syndromes(self, pages: torch.Tensor, outs: torch.Tensor, m: int, L: int) -> None:
        """outs[t] = S_t over `pages` (address arrays; the codec's syndrome kernel)."""
        w = self._windows.get(m)
        if w is None:
            from leto_runtime.parity import gf16
            w = self._windows[m] = self._be._window(np.eye(m, dtype=np.uint16), gf16.exponents(m))
        if self.cuda:
            self._be.ext.syndrome_mix(pages, outs, w, L, self._be.ext.VARIANTS[self._be.variant],
                                      None, 1, None)
        else:
            self._be.ext.syndrome_mix(pages, outs, w, L)

    def _slice_ok(self, i: int, g: int, a: int, L: int) -> bool:
        """Are all syndromes of bytes [a, a+L) of group g of model state i zero, both tiers?"""
        H1, H2 = self.ss.geo.tier1, self.ss.geo.tier2
        st = self.ss.model[i]
        data, p1, p2 = self._group_ptrs(i, g)
        buf = self.ss.qbuf.pages(0, self.ss.qbuf.n_pages).view(-1)
        if self.cuda:                              # stage the host rows of the slice
            stage = buf[:(H1 + H2) * L].view(H1 + H2, L)
            h1, h2 = st.tier1(g), st.tier2(g)
            for r in range(H1):
                stage[r].copy_(h1[r, a:a + L], non_blocking=True)
            for r in range(H2):
                stage[H1 + r].copy_(h2[r, a:a + L], non_blocking=True)
            rows2 = self._ptrs(stage.data_ptr(), H1 + H2, L)
            rows1 = rows2[:H1]
            out = buf[(H1 + H2) * L:(2 * H1 + H2) * L]
        else:
            rows1 = p1 + a
            rows2 = torch.cat([rows1, p2 + a]) if H2 else None
            out = buf[:H1 * L]
        outs = self._ptrs(out.data_ptr(), H1, L)
        self._syndromes(self._dev(torch.cat([data + a, rows1])), self._dev(outs), H1, L)
        ok = not bool(out.any())
        if ok and H2:
            self._syndromes(self._dev(rows2), self._dev(outs[:H2]), H2, L)
            ok = not bool(out[:H2 * L].any())
        return ok

    # ---- a mismatch --------------------------------------------------------------------------
    def _full_check(self, t: int, i: int, g: int) -> None:
        st = self.ss.model[i]
        v = self._verdict(st, g)
        fields = dict(step=t, state=st.name, group=g, action=v.action, reason=v.reason)
        if v.action == "reencode":
            self.up._encode_into_host(st, g)
            self.up.fence()
            after = self._verdict(st, g)
            if after.action != "ok":
                v = Verdict("unrecoverable", f"{v.reason}; still inconsistent after the "
                            f"re-encode: {after.reason}")
                fields.update(action=v.action, reason=v.reason)
            else:
                self.stats.repaired += 1
        self.report("scrub", **fields)
        if v.action == "unrecoverable":
            gi = st.groups[g]
            loss = GroupLoss(st.name, gi.id, g, [], [], [], self.ss.geo.tier1)
            raise Unrecoverable(f"the scrub found group {g} of {st.name!r} inconsistent at step "
                                f"{t}: {v.reason}", ReconstructReport(unrecoverable=[loss]))

    def _verdict(self, st, g: int) -> Verdict:
        up, dev = self.up, torch.device(self.ss.device)
        k = st.groups[g].k
        data = list(st.group_pages(g).unbind(0))
        p1 = st.tier1(g).to(dev) if self.cuda else st.tier1(g)
        t1 = up.code(k).scrub(data + list(p1.unbind(0)))
        t2 = None
        if up.t2 is not None:
            p2 = st.tier2(g).to(dev) if self.cuda else st.tier2(g)
            t2 = up.t2.scrub(list(p1.unbind(0)) + list(p2.unbind(0)))
        return verdict(t1, t2, k)
