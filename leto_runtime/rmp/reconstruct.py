"""Page reconstruction for the trainer: tier 2 repairs tier 1, tier 1 repairs data, in place.

Role (paper §4.2; docs/MEMORY.md, "Remap and reconstruction"): after `RmpClient.localize()` marked
the failed pages and `RmpClient.remap()` put fresh memory behind them, rebuild the contents of
every protected state's failed pages from the surviving data and parity (docs/PARITY.md,
"Tolerance"), then tell the state manager the marks are cleared.  Per protection group (k data
pages, H1 tier-1, H2 tier-2):

1. lost tier-1 pages are rebuilt from the tier-2 code (k=H1, m=H2) when at most H2 of the
   group's H1+H2 parity pages are lost; otherwise they become erasures of step 2;
2. lost data pages (and tier-1 pages step 1 could not rebuild) are decoded from the tier-1
   code (k, m=H1): at most H1 erasures per group;
3. lost tier-2 pages are re-encoded from the (now complete) tier-1 pages.

Every group is checked *before anything is written*: if any group lost more than it tolerates,
`Unrecoverable` is raised (typed: the recovery protocol falls back to a checkpoint) and no page
of any state is touched -- no silent overwrite.  Unprotected state has nothing to rebuild: its
remapped pages are reported as "contents undefined".

The parity must be consistent with the data (the trainer -- RMU -- keeps it so); a decode is
checked against the syndromes it left over, so a silent corruption among the survivors is
corrected where it can be located, else Unrecoverable (verify.py).  `protect()` encodes every
group from scratch (first initialization, tests).

Codec: `leto_runtime.parity.ParityCode` (GF(2^16), docs/PARITY.md), one code per tier and group
shape; `backend` is passed through ('auto': CUDA kernels for GPU pages, C++ for host pages).
On GPUs the group's parity (host, pinned) is staged to the device, decoded there with the data
pages rebuilt in place, and the repaired parity rows are copied back to the host; with the CUDA
kernels this takes `_repair_group_cuda` (address arrays, split decode overlapping the parity
copy: see "the CUDA path" below), otherwise the staged path through `ParityCode`.

Calling contract: `recover(client)` = localize + remap + reconstruct; `reconstruct(client)`
requires that no page awaits remapping.  Both return a `ReconstructReport` or raise
`Unrecoverable` (an `RmpError` with code "unrecoverable", carrying the report).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from leto_runtime.rmp.verify import ParityMismatch, decode_checked
from leto_runtime.wire import settings
from leto_runtime.wire import protocol as P


class Unrecoverable(P.RmpError):
    """More pages lost in some group than its parity tolerates; nothing was written."""

    code = P.ErrorCode.UNRECOVERABLE

    def __init__(self, message: str, report: "ReconstructReport"):
        self.report = report
        super().__init__(message, {"groups": [g.__dict__ for g in report.unrecoverable]})


class NotRemapped(P.RmpError):
    """Some failed pages still have no memory behind them: call `RmpClient.remap()` first."""

    code = P.ErrorCode.BAD_ARGUMENT


@dataclass
class GroupLoss:
    state: str
    group: int                 # pool-wide group id
    index: int                 # position in the state
    data: list[int]            # lost data pages (indices in the state)
    p1: list[int]
    p2: list[int]
    tolerance: int             # H1

    @property
    def erasures(self) -> int:
        return len(self.data)


@dataclass
class ReconstructReport:
    repaired: list[GroupLoss] = field(default_factory=list)
    unrecoverable: list[GroupLoss] = field(default_factory=list)
    undefined: list[dict] = field(default_factory=list)   # unprotected pages remapped empty
    seconds: float = 0.0
    backend: str = ""

    @property
    def pages(self) -> int:
        return sum(len(g.data) + len(g.p1) + len(g.p2) for g in self.repaired)


# ---- the codec ---------------------------------------------------------------------------
class _Tiers:
    """The two codes of one group shape, through `leto_runtime.parity.ParityCode`."""

    def __init__(self, k: int, h1: int, h2: int, page_bytes: int, backend: str):
        from leto_runtime.parity import ParityCode

        self.t1 = ParityCode(k, h1, page_bytes, backend=backend)
        self.t2 = ParityCode(h1, h2, page_bytes, backend=backend) if h2 else None


def _staged(host, device):
    """Parity pages on the data's device: the host tensor itself on CPU, a (pinned) copy on GPU."""
    if host is None or device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)


# ---- planning ----------------------------------------------------------------------------
def _losses(client, names) -> tuple[list[GroupLoss], list[str]]:
    losses, waiting = [], []
    for name in names:
        st = client.states[name]
        if st.marks.unmapped:
            waiting.append(name)
        if not st.protected:
            continue
        for g in st.groups:
            d = [i for i in st.marks.data if g.first <= i < g.first + g.k]
            p1, p2 = st.marks.p1.get(g.index, []), st.marks.p2.get(g.index, [])
            if d or p1 or p2:
                losses.append(GroupLoss(name, g.id, g.index, d, list(p1), list(p2), st.h1))
    return losses, waiting


def _tier2_can_repair(st, loss: GroupLoss) -> bool:
    return st.h2 > 0 and len(loss.p1) + len(loss.p2) <= st.h2


def _feasible(st, loss: GroupLoss) -> bool:
    unrepaired_p1 = 0 if _tier2_can_repair(st, loss) else len(loss.p1)
    return len(loss.data) + unrepaired_p1 <= st.h1


# ---- the API -----------------------------------------------------------------------------
def reconstruct(client, names: list[str] | None = None, *, backend: str = "auto",
                clear: bool = True) -> ReconstructReport:
    """Rebuild every marked page of the attached protected states (see module docstring)."""
    t0 = time.perf_counter()
    names = list(client.states) if names is None else names
    losses, waiting = _losses(client, names)
    if waiting:
        raise NotRemapped(f"states {waiting} have pages awaiting remap; call remap() first")
    report = ReconstructReport(backend=backend,
                               undefined=[e for e in getattr(client, "last_remap", [])
                                          if e.get("contents") == "undefined"])
    for loss in losses:
        if not _feasible(client.states[loss.state], loss):
            report.unrecoverable.append(loss)
    if report.unrecoverable:
        report.seconds = time.perf_counter() - t0
        worst = max(report.unrecoverable, key=lambda g: g.erasures)
        raise Unrecoverable(f"{len(report.unrecoverable)} protection group(s) lost more pages "
                            f"than their parity tolerates (e.g. group {worst.group} of "
                            f"{worst.state!r}: {len(worst.data)} data + {len(worst.p1)} tier-1 "
                            f"+ {len(worst.p2)} tier-2 lost, tolerance {worst.tolerance}); "
                            "nothing was written: recover from a checkpoint", report)
    for loss in losses:
        _repair_group(client.states[loss.state], loss, backend)
        report.repaired.append(loss)
    for n in names:
        _sync_state(client.states[n])
    if clear:
        for name in {g.state for g in losses}:
            client.clear_marks(name)
    report.seconds = time.perf_counter() - t0
    return report


def _repair_group(st, loss: GroupLoss, backend: str) -> None:
    """Repair one group in place (see the module docstring): the address-array path on CUDA
    pages with the CUDA kernels, else the staged path (CPU pages, reference backend).  Either
    checks the result against the syndromes the decode left over (verify.py); the CUDA path
    hands a mismatch to the staged one, which locates and corrects what it can.  What cannot
    be trusted raises Unrecoverable (lost pages hold garbage; no survivor was overwritten)."""
    try:
        if settings.get().rmp_reconstruct_path != "staged" and st.device.startswith("cuda"):
            be = _cuda_kernels(backend, st)
            if be is not None and _repair_group_cuda(st, loss, be):
                return
        _repair_group_staged(st, loss, backend)
    except ParityMismatch as e:
        raise Unrecoverable(f"group {loss.index} of {loss.state!r}: {e}; recover from a checkpoint",
                            ReconstructReport(unrecoverable=[loss])) from e


def _repair_group_staged(st, loss: GroupLoss, backend: str) -> None:
    """The general path through `ParityCode` (page tensors, every parity row staged).  On CUDA
    it is the reference of `_repair_group_cuda` (tests compare both)."""
    H1, H2 = st.h1, st.h2
    g = st.groups[loss.index]
    codes = _Tiers(g.k, H1, H2, st.page_bytes, backend)
    data = st.group_pages(loss.index)                # (k, S) zero-copy view, device or host
    dev = data.device
    p1h, p2h = st.tier1(loss.index), st.tier2(loss.index)
    p1, p2 = _staged(p1h, dev), _staged(p2h, dev)
    lost_d = sorted(i - g.first for i in loss.data)
    lost1, lost2 = sorted(loss.p1), sorted(loss.p2)
    changed1: set[int] = set()
    changed2: set[int] = set()
    # 1. tier 2 -> tier 1 (decode writes straight into the staged parity rows)
    via_t2 = bool(lost1) and _tier2_can_repair(st, loss)
    if via_t2:
        pages = [None if i in lost1 else p1[i] for i in range(H1)] + \
                [None if i in lost2 else p2[i] for i in range(H2)]
        codes.t2.decode(pages, out={**{i: p1[i] for i in lost1}, **{H1 + i: p2[i] for i in lost2}})
        changed1.update(lost1)
        changed2.update(lost2)
    # 2. tier 1 -> data pages, in place (plus the tier-1 pages tier 2 could not rebuild)
    bad1 = [] if via_t2 else lost1
    if lost_d or lost1:
        rows = list(data.unbind(0))
        pages = [None if j in lost_d else rows[j] for j in range(g.k)] + \
                [None if i in bad1 else p1[i] for i in range(H1)]
        fixed = decode_checked(codes.t1, pages, {**{j: rows[j] for j in lost_d},
                                                 **{g.k + i: p1[i] for i in bad1}},
                               what=f"group {loss.index} of {loss.state!r}").corrected
        changed1.update(bad1 + [j - g.k for j in fixed if j >= g.k])
    # 3. tier 1 -> tier 2 (lost tier-2 pages, or tier-1 pages rebuilt by tier 1)
    if H2 and ((lost2 and not via_t2) or bad1):
        codes.t2.encode(p1, out=p2)
        changed2.update(range(H2))
    if dev.type != "cpu":                            # the host parity is the authoritative copy
        for i in sorted(changed1):
            p1h[i].copy_(p1[i])
        for i in sorted(changed2):
            p2h[i].copy_(p2[i])


# ---- the CUDA path -----------------------------------------------------------------------
# Why a second path: through `ParityCode` most of a repair was Python over 1,040 page views,
# staging every parity row first and blocking copies back.  Here the data pages are addresses
# from the mapping's base, the decode is split by linearity so that the parity rows' H2D copy
# overlaps the kernel over the data pages, and tier-2 rows are staged only when used.
#
#   lost c_L = A^-1 S_R,  S_t = sum_{j in data survivors} x^(j t) d_j  +  sum_{l in parity survivors} x^((k+l) t) p_l
#            = mix(A^-1, syndromes over the data only)                     [syndrome_mix, n = k]
#            ^ sum_l (A^-1 V)[:, l] * p_l,  V[c][l] = x^((k+l) t_c)        [delta_update, n = #parity]
#
# Both kernels are the codec's (cuda/parity_cuda.cu, reference leto_runtime/parity/reference.py);
# `split_coefficients` is their glue, checked against ParityCode.decode by the unit tests.
STAGE_TIMES: list | None = None    # benchmarks: a list -> (stage, seconds) appended, synchronized
_log = logging.getLogger("leto.rmp")
_warned: set[str] = set()
_side_streams: dict = {}


def split_coefficients(k: int, m: int, lost: tuple[int, ...], parity_survivors: list[int]):
    """(coef, ts, coef2) of the split decode above: `coef` (e x e) mixes the syndromes R = ts
    over the data survivors; `coef2` (e x len(parity_survivors)) multiplies each surviving parity
    page (index l of the tier, position k+l) into the lost pages."""
    from leto_runtime.parity import gf16

    coef = gf16.decode_matrix(k, m, lost)
    ts = gf16.exponents(m)[:len(lost)]
    if not parity_survivors:
        return coef, ts, np.zeros((len(lost), 0), dtype=np.uint16)
    pos = np.asarray([k + l for l in parity_survivors], dtype=np.int64)
    V = gf16.EXP[np.mod(np.outer(np.asarray(ts, dtype=np.int64), pos), gf16.ORDER)].astype(np.uint16)
    return coef, ts, gf16.mat_mul(coef, V)


def prepare_kernels(st, backend: str = "auto") -> None:
    """Load what reconstructing `st` would use (a waiting shadow calls it; nothing is read or
    written)."""
    if st.device.startswith("cuda"):
        _cuda_kernels(backend, st)


def _cuda_kernels(backend: str, st):
    """The CUDA kernel backend when `backend` resolves to it for these pages, else None (the
    staged path then goes through `ParityCode`, which warns once for 'auto' falling back)."""
    import torch

    from leto_runtime.parity import backends

    if backend not in ("auto", "cuda") or st.h1 > 16:
        return None
    be = backends.select(backend, torch.device(st.device), st.h1)
    if isinstance(be, backends.CudaBackend):
        return be
    if "fallback" not in _warned:
        _warned.add("fallback")
        _log.warning("leto rmp: CUDA parity kernels unavailable; reconstruction takes the staged "
                     "path with backend %r (%s)", backend, getattr(be, "name", be))
    return None


class _Stages:
    """Stage timer for `STAGE_TIMES` (synchronizes at each mark: profiling only)."""
    def __init__(self, dev):
        self.dev, self.on = dev, STAGE_TIMES is not None
        self.t = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.on:
            import torch
            torch.cuda.synchronize(self.dev)
            t = time.perf_counter()
            STAGE_TIMES.append((name, t - self.t))
            self.t = t


def _repair_group_cuda(st, loss: GroupLoss, be) -> bool:
    """One group on the CUDA path (kernel backend `be`): its parity staged on the side stream,
    the module docstring's steps 1-3 in that order, the check, then the changed parity rows
    back.  False: the check failed and nothing went back (the caller takes the staged path)."""
    r = _CudaRepair(st, loss)
    r.stage()
    if r.via_t2:
        r.tier2_decode()
    if r.lost_d or r.bad1:
        r.tier1_decode(be)
    if r.reencode2:
        r.tier2_encode()
    if not r.consistent():
        return False        # nothing went back to the host: the staged path starts afresh
    r.parity_back()
    return True


class _CudaRepair:
    """One group's repair on the CUDA path: what was lost and which steps repair it, the staged
    parity, the streams.  Its buffers live as long as it does (`_repair_group_cuda`'s call)."""

    def __init__(self, st, loss: GroupLoss):
        import torch

        self.st = st
        self.H1, self.H2, self.S = st.h1, st.h2, st.page_bytes
        self.g = st.groups[loss.index]
        self.k = self.g.k
        self.dev = dev = torch.device(st.device)
        self.clock = _Stages(dev)
        self.main = torch.cuda.current_stream(dev)
        side = _side_streams.get(dev)
        if side is None:
            side = _side_streams[dev] = torch.cuda.Stream(dev)
        self.side = side
        self.p1h, self.p2h = st.tier1(loss.index), st.tier2(loss.index)
        self.lost_d = sorted(i - self.g.first for i in loss.data)
        self.lost1, self.lost2 = sorted(loss.p1), sorted(loss.p2)
        self.via_t2 = bool(self.lost1) and _tier2_can_repair(st, loss)
        self.bad1 = [] if self.via_t2 else self.lost1
        self.reencode2 = bool(self.H2) and ((bool(self.lost2) and not self.via_t2)
                                            or bool(self.bad1))
        self.changed1: set[int] = set()
        self.changed2: set[int] = set()

    def stage(self) -> None:
        """Staging: tier 1 always, tier 2 only when read (tier-2 decode).  Buffers come from
        the main stream (the allocator's owner); the side stream waits for it first."""
        import torch

        H1, H2, S, dev, side = self.H1, self.H2, self.S, self.dev, self.side
        self.p1 = torch.empty((H1, S), dtype=torch.uint8, device=dev)
        self.p2 = (torch.empty((H2, S), dtype=torch.uint8, device=dev)
                   if (self.via_t2 or self.reencode2) else None)
        side.wait_stream(self.main)
        with torch.cuda.stream(side):
            self.p1.copy_(self.p1h, non_blocking=True)
            if self.via_t2:
                self.p2.copy_(self.p2h, non_blocking=True)
        self.staged = torch.cuda.Event()
        self.staged.record(side)
        self.clock.mark("stage parity (issue)")

    def tier2_decode(self) -> None:
        """1. tier 2 -> tier 1 (small: H1 + H2 pages), through the codec's page API."""
        from leto_runtime.parity import ParityCode
        H1, H2, S, p1, p2 = self.H1, self.H2, self.S, self.p1, self.p2
        lost1, lost2 = self.lost1, self.lost2
        self.main.wait_event(self.staged)
        pages = [None if i in lost1 else p1[i] for i in range(H1)] + \
                [None if i in lost2 else p2[i] for i in range(H2)]
        ParityCode(H1, H2, S, backend="cuda").decode(
            pages, out={**{i: p1[i] for i in lost1}, **{H1 + i: p2[i] for i in lost2}})
        self.changed1.update(lost1)
        self.changed2.update(lost2)
        self.clock.mark("tier-2 decode")

    def tier1_decode(self, be) -> None:
        """2. tier 1 -> data pages (and tier-1 pages tier 2 could not rebuild), split as above.
        Order: the data kernel is queued as soon as A^-1 is known; the parity coefficients
        (A^-1 V, CPU) are computed while it runs."""
        import torch

        from leto_runtime.parity import gf16

        k, H1, S, main, clock = self.k, self.H1, self.S, self.main, self.clock
        lost_d, bad1 = self.lost_d, self.bad1
        lost = tuple(lost_d) + tuple(k + i for i in bad1)
        survivors1 = [i for i in range(H1) if i not in bad1]
        e, L = len(lost), len(survivors1)
        coef, ts = gf16.decode_matrix(k, H1, lost), gf16.exponents(H1)[:e]
        clock.mark("decode matrix")
        n_addr = self._addresses(e, survivors1)
        hbuf, host, dbuf = self.hbuf, self.host, self.dbuf
        pages_t, outs_t = dbuf[:k], dbuf[k:k + e]
        a_t, b_t = dbuf[k + e:k + e + L], dbuf[k + e + L:n_addr]
        clock.mark("addresses")
        if bad1:
            main.wait_event(self.staged)   # outputs in p1: the staging copy must be done first
        be.ext.syndrome_mix(pages_t, outs_t, be._window(coef, ts), S, be.ext.VARIANTS[be.variant])
        clock.mark("decode kernel, data pages")
        if L:
            _, _, coef2 = split_coefficients(k, H1, lost, survivors1)
            host[n_addr:].view(np.int32)[:e * L] = coef2.astype(np.int32).reshape(-1)
            dbuf[n_addr:].copy_(hbuf[n_addr:], non_blocking=True)
            coef2_t = dbuf[n_addr:].view(torch.int32)[:e * L]
            clock.mark("parity coefficients")
            main.wait_event(self.staged)
            be.ext.delta_update(outs_t, a_t, b_t, coef2_t, S)
            clock.mark("parity term (delta kernel)")
        self.changed1.update(bad1)

    def _addresses(self, e: int, survivors1: list[int]) -> int:
        """One pinned host array (`hbuf`, its NumPy view `host`), one H2D copy into `dbuf`: data
        addresses (0 = lost: an all-zero page), output addresses, parity addresses, a zero "b"
        array; room for coef2 at the end, which follows in a second copy.  Returns the number
        of addresses."""
        import torch

        k, S, L = self.k, self.S, len(survivors1)
        lost_d, bad1 = self.lost_d, self.bad1
        base, p1_base = self.st._data.addr(self.g.first), self.p1.data_ptr()
        n32 = (e * L + 1) // 2
        n_addr = k + e + 2 * L
        # torch's caching host allocator: reused once the copies that read a block completed
        self.hbuf = hbuf = torch.empty(n_addr + n32, dtype=torch.int64, pin_memory=True)
        self.host = host = hbuf.numpy()
        host[:k] = base + np.arange(k, dtype=np.int64) * S
        host[np.asarray(lost_d, dtype=np.int64)] = 0
        host[k:k + e] = [base + j * S for j in lost_d] + [p1_base + i * S for i in bad1]
        host[k + e:k + e + L] = [p1_base + i * S for i in survivors1]
        host[k + e + L:] = 0
        self.dbuf = dbuf = torch.empty(n_addr + n32, dtype=torch.int64, device=self.dev)
        dbuf[:n_addr].copy_(hbuf[:n_addr], non_blocking=True)
        return n_addr

    def consistent(self) -> bool:
        """The completed tier-1 codeword against the syndromes the decode left over."""
        from leto_runtime.parity import ParityCode
        if len(self.lost_d) + len(self.bad1) >= self.H1:
            return True                                 # nothing left to check with
        self.main.wait_event(self.staged)
        pages = list(self.st.group_pages(self.g.index).unbind(0)) + list(self.p1.unbind(0))
        return ParityCode(self.k, self.H1, self.S, backend="cuda").scrub(pages, locate=False).consistent

    def tier2_encode(self) -> None:
        """3. tier 1 -> tier 2 (lost tier-2 pages, or tier-1 pages rebuilt by tier 1)."""
        from leto_runtime.parity import ParityCode
        self.main.wait_event(self.staged)
        ParityCode(self.H1, self.H2, self.S, backend="cuda").encode(self.p1, out=self.p2)
        self.changed2.update(range(self.H2))

    def parity_back(self) -> None:
        """Changed rows back to the host parity (the authoritative copy), in host memory on
        return; data-page repairs stay queued (callers synchronize before clearing marks)."""
        main, p1, p2 = self.main, self.p1, self.p2
        main.wait_event(self.staged)                # p1/p2 are freed on the main stream
        if self.changed1 or self.changed2:
            for i in sorted(self.changed1):
                self.p1h[i].copy_(p1[i], non_blocking=True)
            for i in sorted(self.changed2):
                self.p2h[i].copy_(p2[i], non_blocking=True)
            main.synchronize()
        self.clock.mark("parity back")


def protect(state, *, backend: str = "auto") -> None:
    """Encode every group's tier-1 parity from its data and tier 2 from tier 1 (full encode)."""
    for g in state.groups:
        codes = _Tiers(g.k, state.h1, state.h2, state.page_bytes, backend)
        data = state.group_pages(g.index)
        p1h, p2h = state.tier1(g.index), state.tier2(g.index)
        p1 = codes.t1.encode(data) if data.device.type != "cpu" else codes.t1.encode(data, out=p1h)
        if codes.t2 is not None:
            p2 = codes.t2.encode(p1) if data.device.type != "cpu" else codes.t2.encode(p1, out=p2h)
        if data.device.type != "cpu":
            p1h.copy_(p1)
            if codes.t2 is not None:
                p2h.copy_(p2)
    _sync_state(state)


def _sync_state(st) -> None:
    if st.device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(st.device)


def recover(client, names: list[str] | None = None, **kw) -> tuple:
    """localize -> remap -> reconstruct; returns (LocalizeReport, ReconstructReport)."""
    loc = client.localize()
    if any(m.unmapped for m in loc.marks.values()):
        client.remap(names)
    return loc, reconstruct(client, names, **kw)
