"""The parity codec's public face: a code object and a two-tier protection group.

    code = ParityCode(k=1024, m=16, page_bytes=2 << 20, backend="auto")
    parity = code.encode(data)                    # (m, S) uint8 tensor on data's device
    code.update(parity, j, old, new)              # parity ^= G[:, j] * (old ^ new), in place
    code.update(q_new, range(f, f + n), old, new, base=q_old, scratch=buf)   # q_new = q_old ^ delta
    rebuilt = code.decode(pages_with_None_for_lost)   # {position: page}; > m lost -> TooManyErasures
    report = code.scrub(data_and_parity)          # all syndromes zero <=> consistent; locates bad pages

    group = ProtectionGroup(D=1024, H1=16, H2=1)  # tier 2 protects the tier-1 parity pages
    p1, p2 = group.encode(data); group.update(p1, p2, j, old, new); group.decode(data, p1, p2)

Pages: a list of tensors (any dtype, contiguous, `page_bytes` bytes each; they need not be
contiguous with each other) or one stacked contiguous tensor, all on one device (CPU or CUDA).
The kernels address pages by their base address, so the dtype does not matter.
Outputs are written in place or returned as a stacked uint8 tensor.  On CUDA, work is queued on
the current stream and nothing synchronizes.  Backends: see backends.py.  The code itself is
docs/PARITY.md; coefficients come from gf16.py.
"""
from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch

from . import backends, gf16, reference
from . import delta as _delta
from .errors import PageShapeError, TooManyErasures

Pages = Union[torch.Tensor, Sequence[torch.Tensor]]
DEFAULT_PAGE_BYTES = 2 << 20


def _as_pages(pages, count: int, page_bytes: int, what: str, allow_none: bool = False):
    """Validate pages without copying or re-viewing them (a 1040-page group is checked in
    ~0.3 ms; creating per-page uint8 views would cost 5x that).  Returns (list, device)."""
    if isinstance(pages, torch.Tensor):
        if not pages.is_contiguous() or pages.dim() < 1 or pages.shape[0] != count:
            raise PageShapeError(f"{what}: a stacked tensor must be contiguous with {count} rows, got shape "
                                 f"{tuple(pages.shape)}")
        pages = pages.unbind(0)
    pages = list(pages)
    if len(pages) != count:
        raise PageShapeError(f"{what}: expected {count} pages, got {len(pages)}")
    device = None
    for i, p in enumerate(pages):
        if p is None:
            if not allow_none:
                raise PageShapeError(f"{what}[{i}] is None")
            continue
        if not isinstance(p, torch.Tensor):
            raise PageShapeError(f"{what}[{i}]: expected a torch.Tensor, got {type(p).__name__}")
        if p.nbytes != page_bytes or not p.is_contiguous():
            raise PageShapeError(f"{what}[{i}]: need a contiguous page of {page_bytes} bytes, got "
                                 f"{p.nbytes} bytes (contiguous={p.is_contiguous()})")
        if device is None:
            device = p.device
        elif p.device != device:
            raise PageShapeError(f"{what}[{i}] is on {p.device}, others on {device}")
    return pages, device


def _indices(index, k: int) -> list[int]:
    idx = [operator.index(index)] if not isinstance(index, (list, tuple, range, np.ndarray, torch.Tensor)) \
        else [operator.index(int(i)) for i in index]
    for j in idx:
        if not 0 <= j < k:
            raise IndexError(f"data page index {j} outside 0..{k - 1}")
    return idx


def _targets(parity, par: list, base, rows: int, page_bytes: int, dev):
    """(parity, base) for delta.py: stacked tensors where both are (one XOR over all rows), else
    page lists; base None when absent or when it is the parity itself (then: in place)."""
    if base is None:
        return (parity if isinstance(parity, torch.Tensor) else par), None
    bpages, bdev = _as_pages(base, rows, page_bytes, "base")
    if bdev != dev:
        raise PageShapeError(f"base is on {bdev}, pages on {dev}")
    if [b.data_ptr() for b in bpages] == [p.data_ptr() for p in par]:
        return (parity if isinstance(parity, torch.Tensor) else par), None
    if isinstance(parity, torch.Tensor) and isinstance(base, torch.Tensor):
        return parity, base
    return par, bpages


def _copy_pages(dst, src, page_bytes: int) -> None:
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        _delta.u8(dst).copy_(_delta.u8(src))
        return
    for d, s_ in zip(dst, src):
        _delta.u8(d).copy_(_delta.u8(s_))


def _check_scratch(scratch, dev) -> None:
    if scratch is None:
        return
    if not isinstance(scratch, torch.Tensor) or not scratch.is_contiguous() or scratch.device != dev:
        raise PageShapeError(f"scratch must be a contiguous tensor on {dev}")


@dataclass(frozen=True)
class ScrubReport:
    """Result of a syndrome scrub.

    `consistent`: every syndrome is zero.  `bad_symbols`: symbol positions (of S/2 per page) with
    a non-zero syndrome.  `suspects`: position -> number of inspected symbol positions at which
    that page was located as corrupted (Berlekamp-Massey, up to m/2 pages per symbol position).
    `inspected` / `unlocated`: symbol positions examined / not explained by <= m/2 bad pages.
    """

    consistent: bool
    bad_symbols: int = 0
    suspects: dict = field(default_factory=dict)
    inspected: int = 0
    unlocated: int = 0


class ParityCode:
    """Systematic Reed-Solomon code over GF(2^16) on pages: k data pages, m parity pages.

    Any m lost pages (data or parity) can be rebuilt.  `backend` is 'auto' (kernels for the
    pages' device, NumPy reference with a warning if they cannot run), 'reference', 'cpu' or
    'cuda'; the kernels support m <= 16.
    """

    def __init__(self, k: int = 1024, m: int = 16, page_bytes: int = DEFAULT_PAGE_BYTES, *,
                 backend: str = "auto"):
        for name, v in (("k", k), ("m", m), ("page_bytes", page_bytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {v!r}")
        gf16.check_shape(int(k), int(m))
        gf16.check_page_bytes(int(page_bytes))
        if backend not in backends.BACKENDS:
            raise ValueError(f"backend must be one of {backends.BACKENDS}, got {backend!r}")
        self.k, self.m, self.page_bytes, self.backend = int(k), int(m), int(page_bytes), backend
        self.exponents = gf16.exponents(self.m)
        self._last_plan: Optional[_delta.DeltaPlan] = None

    def __repr__(self) -> str:
        return f"ParityCode(k={self.k}, m={self.m}, page_bytes={self.page_bytes}, backend={self.backend!r})"

    @property
    def G(self) -> np.ndarray:
        """Generator (m x k, uint16, read-only): parity_i = sum_j G[i][j] * data_j."""
        return gf16.generator(self.k, self.m)

    def backend_for(self, device: torch.device):
        """The backend object that serves pages on `device` (resolves 'auto')."""
        return backends.select(self.backend, device, self.m)

    def _outputs(self, out, count: int, device) -> tuple[list[torch.Tensor], object]:
        if out is None:
            t = torch.empty((count, self.page_bytes), dtype=torch.uint8, device=device)
            return list(t), t
        outs, odev = _as_pages(out, count, self.page_bytes, "out")
        if odev != device:
            raise PageShapeError(f"out is on {odev}, inputs on {device}")
        return outs, out

    def encode(self, data: Pages, out: Optional[Pages] = None):
        """Parity of k data pages: returns a new (m, page_bytes) uint8 tensor, or fills `out`."""
        d, dev = _as_pages(data, self.k, self.page_bytes, "data")
        outs, ret = self._outputs(out, self.m, dev)
        self.backend_for(dev).syndrome_mix(d, outs, gf16.encode_matrix(self.k, self.m),
                                           self.exponents, self.page_bytes)
        return ret

    def update(self, parity: Pages, index, old: Pages, new: Pages, *, scratch: Optional[torch.Tensor] = None,
               base: Optional[Pages] = None, method: str = "auto") -> None:
        """Data pages `index` (int or list) changed from `old` to `new`: patch `parity` in place.

        A contiguous run of pages (index = first, first+1, ...) long enough goes through the
        encode kernel on old ^ new (delta.py; `method` 'auto' | 'pagewise' | 'syndrome' forces
        one; LETO_PARITY_DELTA sets the default).  `scratch`: optional contiguous tensor (any dtype, on the pages' device, overlapping
        none of the other arguments) for old ^ new (count pages) and the temp (m pages) that
        path needs; what does not fit is allocated.  `base`: when given, parity = base ^ delta
        (parity is only written: saves a copy of the old parity into it).
        """
        idx = _indices(index, self.k)
        olds, dev = _as_pages(old, len(idx), self.page_bytes, "old")
        news, ndev = _as_pages(new, len(idx), self.page_bytes, "new")
        stacked = (old if isinstance(old, torch.Tensor) else None, new if isinstance(new, torch.Tensor) else None)
        self._delta(parity, idx, olds, news, dev, ndev, stacked, scratch, base, method)

    def prepare_update(self, parity: Pages, index, old: Pages, new: Pages, *,
                       base: Optional[Pages] = None):
        """update(parity, index, old, new, base=base) as a call with nothing left to look up or
        check, for pages that stay where they are; None where it does not apply (then call
        update()).  Applies on CPU when the plan is pagewise (a short run, as RMU's chunks on
        CPU): the call copies base into parity, then runs the pagewise kernel, exactly what
        update() does there.  It holds the pages' addresses, not the tensors (no view is kept
        alive), so the caller must not call it once any of those pages moved or was unmapped."""
        idx = _indices(index, self.k)
        olds, dev = _as_pages(old, len(idx), self.page_bytes, "old")
        news, ndev = _as_pages(new, len(idx), self.page_bytes, "new")
        par, pdev = _as_pages(parity, self.m, self.page_bytes, "parity")
        if not (dev == ndev == pdev):
            raise PageShapeError(f"parity on {pdev}, old on {dev}, new on {ndev}: use one device")
        be = self.backend_for(dev)
        prep = getattr(be, "prepared_delta", None)
        plan = _delta.choose(be.name, self.m, self.m, idx, method=_delta.method_from_env("auto"))
        if dev.type != "cpu" or prep is None or plan.method != "pagewise":
            return None
        moves = []
        if base is not None:
            bpages, bdev = _as_pages(base, self.m, self.page_bytes, "base")
            if bdev != dev:
                raise PageShapeError(f"base is on {bdev}, pages on {dev}")
            moves = [(p.data_ptr(), b.data_ptr()) for p, b in zip(par, bpages) if p.data_ptr() != b.data_ptr()]
        kernel = prep(par, olds, news, self.G[:, idx], self.page_bytes)
        n = self.page_bytes

        def call() -> None:
            for dst, src in moves:
                ctypes.memmove(dst, src, n)
            kernel()
            self._last_plan = plan
        return call

    def update_delta(self, parity: Pages, index, delta: Pages, *, scratch: Optional[torch.Tensor] = None,
                     base: Optional[Pages] = None, method: str = "auto") -> None:
        """Like update() with delta = old ^ new given directly."""
        idx = _indices(index, self.k)
        deltas, dev = _as_pages(delta, len(idx), self.page_bytes, "delta")
        self._delta(parity, idx, deltas, [None] * len(idx), dev, dev, (None, None), scratch, base, method)

    def update_delta_many(self, parities: Sequence[Pages], index, deltas: Sequence[Pages], *,
                          bases: Sequence[Pages], method: str = "auto") -> None:
        """update_delta(parities[y], index, deltas[y], base=bases[y]) for several independent
        page sets (RMU: params, exp_avg, exp_avg_sq of one chunk).  On CUDA a contiguous run goes
        through one batched syndrome launch with the code's own encode matrix, the run's offset
        applied as a per-syndrome scale (delta.run_scale) and parity = base ^ delta written in the
        kernel's epilogue; otherwise one update_delta per set."""
        idx = _indices(index, self.k)
        if len(parities) != len(deltas) or len(bases) != len(deltas):
            raise PageShapeError(f"{len(parities)} parities, {len(deltas)} deltas, {len(bases)} bases: "
                                 "give one of each per page set")
        checked = [_as_pages(d, len(idx), self.page_bytes, "delta") for d in deltas]
        dev = checked[0][1]
        be = self.backend_for(dev)
        plan = _delta.choose(be.name, self.m, self.m, idx, have_delta=True, method=_delta.method_from_env(method))
        if plan.method == "syndrome" and hasattr(be, "syndrome_mix_batch"):
            outs, bl = [], []
            for par, base in zip(parities, bases):
                pp, pdev = _as_pages(par, self.m, self.page_bytes, "parity")
                bp, bdev = _as_pages(base, self.m, self.page_bytes, "base")
                if not (pdev == bdev == dev):
                    raise PageShapeError(f"parity on {pdev}, base on {bdev}, delta on {dev}: use one device")
                outs.append(pp)
                bl.append(bp)
            if any(c[1] != dev for c in checked):
                raise PageShapeError("the deltas are on different devices")
            be.syndrome_mix_batch([c[0] for c in checked], outs, gf16.encode_matrix(self.k, self.m),
                                  self.exponents, self.page_bytes, bases=bl,
                                  scale=_delta.run_scale(self.m, plan.first))
            self._last_plan = plan
            return
        for par, d, base in zip(parities, deltas, bases):
            self.update_delta(par, idx, d, base=base, method=method)

    def last_delta_plan(self) -> Optional[_delta.DeltaPlan]:
        """How the last update() / update_delta() was computed (method and reason)."""
        return self._last_plan

    def _delta(self, parity, idx, olds, news, dev, ndev, stacked, scratch, base, method) -> None:
        par, pdev = _as_pages(parity, self.m, self.page_bytes, "parity")
        if not (pdev == dev == ndev):
            raise PageShapeError(f"parity on {pdev}, old on {dev}, new on {ndev}: use one device")
        par_obj, base_obj = _targets(parity, par, base, self.m, self.page_bytes, dev)
        be = self.backend_for(dev)
        plan = _delta.choose(be.name, self.m, self.m, idx, have_delta=all(n is None for n in news),
                             method=_delta.method_from_env(method))
        self._last_plan = plan
        if plan.method == "syndrome":
            _check_scratch(scratch, dev)
            deltas, used = _delta.materialize(olds, news, *stacked, self.page_bytes, scratch, dev)
            _delta.syndrome_delta(be, [(par_obj, self.m)], _delta.shifted_encode_matrix(self.k, self.m, plan.first),
                                  self.exponents, deltas, self.page_bytes, scratch=scratch, scratch_used=used,
                                  bases=[base_obj])
            return
        if base_obj is not None:
            _copy_pages(par_obj, base_obj, self.page_bytes)
        be.delta_update(par, olds, news, self.G[:, idx], self.page_bytes)

    def decode(self, pages: Sequence[Optional[torch.Tensor]],
               out: Optional[Mapping[int, torch.Tensor]] = None) -> dict[int, torch.Tensor]:
        """Rebuild the pages given as None (positions 0..k-1 data, k..k+m-1 parity).

        Returns {position: page}; pages come from `out` when it has the position (e.g. freshly
        remapped memory), else are new.  More than m lost pages raises TooManyErasures before
        anything is computed.
        """
        pg, dev = _as_pages(pages, self.k + self.m, self.page_bytes, "pages", allow_none=True)
        lost = tuple(j for j, p in enumerate(pg) if p is None)
        if len(lost) > self.m:
            raise TooManyErasures(lost, self.m)
        if not lost:
            return {}
        out = dict(out or {})
        fresh = [j for j in lost if j not in out]
        if fresh:
            t = torch.empty((len(fresh), self.page_bytes), dtype=torch.uint8, device=dev)
            out.update(zip(fresh, t))
        outs, odev = _as_pages([out[j] for j in lost], len(lost), self.page_bytes, "out")
        if odev != dev:
            raise PageShapeError(f"out is on {odev}, pages on {dev}")
        coef = gf16.decode_matrix(self.k, self.m, lost)
        self.backend_for(dev).syndrome_mix(pg, outs, coef, self.exponents[:len(lost)], self.page_bytes)
        return {j: out[j] for j in lost}

    def syndromes(self, pages: Pages) -> torch.Tensor:
        """S_t for t in T(m) over all k+m pages, as an (m, page_bytes) tensor (zero when consistent)."""
        pg, dev = _as_pages(pages, self.k + self.m, self.page_bytes, "pages")
        outs, ret = self._outputs(None, self.m, dev)
        eye = np.eye(self.m, dtype=np.uint16)
        self.backend_for(dev).syndrome_mix(pg, outs, eye, self.exponents, self.page_bytes)
        return ret

    def scrub(self, pages: Pages, *, locate: bool = True, max_locate: int = 256) -> ScrubReport:
        """Check k+m pages for silent corruption; where syndromes are non-zero, locate the pages
        (at up to `max_locate` symbol positions).  Synchronizes with the device."""
        synd = self.syndromes(pages)
        if not bool(synd.any()):
            return ScrubReport(consistent=True)
        sym = gf16.to_symbols(synd.cpu().numpy())
        bad = np.nonzero(sym.any(axis=0))[0]
        suspects: dict[int, int] = {}
        unlocated = 0
        inspected = bad[:max_locate] if locate else bad[:0]
        for s in inspected:
            where = reference.locate([int(v) for v in sym[:, s]], self.exponents, self.k + self.m)
            if where is None:
                unlocated += 1
            for j in where or ():
                suspects[j] = suspects.get(j, 0) + 1
        return ScrubReport(False, int(bad.size), dict(sorted(suspects.items())), int(len(inspected)), unlocated)


@dataclass(frozen=True)
class Recovery:
    """Pages rebuilt by ProtectionGroup.decode, by position within each tier."""

    data: dict
    tier1: dict
    tier2: dict


class ProtectionGroup:
    """D data pages, H1 tier-1 parity pages over them, H2 tier-2 parity pages over the tier-1 pages.

    Tier 2 lets a lost tier-1 page be repaired without touching the data, and keeps the group
    recoverable when tier-1 pages are lost together with H1 data pages.
    """

    def __init__(self, D: int = 1024, H1: int = 16, H2: int = 1, page_bytes: int = DEFAULT_PAGE_BYTES, *,
                 backend: str = "auto"):
        self.tier1 = ParityCode(D, H1, page_bytes, backend=backend)
        self.tier2 = ParityCode(H1, H2, page_bytes, backend=backend)
        self.D, self.H1, self.H2, self.page_bytes = D, H1, H2, page_bytes
        self._last_plan: Optional[_delta.DeltaPlan] = None

    def __repr__(self) -> str:
        return f"ProtectionGroup(D={self.D}, H1={self.H1}, H2={self.H2}, page_bytes={self.page_bytes})"

    def encode(self, data: Pages, p1_out: Optional[Pages] = None, p2_out: Optional[Pages] = None):
        """Returns (tier-1 parity, tier-2 parity)."""
        p1 = self.tier1.encode(data, p1_out)
        return p1, self.tier2.encode(p1, p2_out)

    def update(self, p1: Pages, p2: Pages, index, old: Pages, new: Pages, *,
               scratch: Optional[torch.Tensor] = None, method: str = "auto") -> None:
        """Data pages changed: patch both tiers in one pass (tier 2 with G2 * G1[:, index]).
        A long enough contiguous run goes through the encode kernel (see ParityCode.update)."""
        idx = _indices(index, self.D)
        olds, dev = _as_pages(old, len(idx), self.page_bytes, "old")
        news, ndev = _as_pages(new, len(idx), self.page_bytes, "new")
        a, adev = _as_pages(p1, self.H1, self.page_bytes, "p1")
        b, bdev = _as_pages(p2, self.H2, self.page_bytes, "p2")
        if not (dev == ndev == adev == bdev):
            raise PageShapeError("old, new, p1 and p2 must be on one device")
        be = self.tier1.backend_for(dev)
        plan = _delta.choose(be.name, self.H1, self.H1 + self.H2, idx, method=_delta.method_from_env(method))
        self._last_plan = plan
        if plan.method == "syndrome":
            _check_scratch(scratch, dev)
            stacked = (old if isinstance(old, torch.Tensor) else None, new if isinstance(new, torch.Tensor) else None)
            deltas, used = _delta.materialize(olds, news, *stacked, self.page_bytes, scratch, dev)
            targets = [(p1 if isinstance(p1, torch.Tensor) else a, self.H1),
                       (p2 if isinstance(p2, torch.Tensor) else b, self.H2)]
            _delta.syndrome_delta(be, targets, _delta.shifted_group_matrix(self.D, self.H1, self.H2, plan.first),
                                  self.tier1.exponents, deltas, self.page_bytes, scratch=scratch,
                                  scratch_used=used, max_outputs=be.max_outputs,
                                  tier2=(gf16.encode_matrix(self.H1, self.H2), gf16.exponents(self.H2)))
            return
        g1 = self.tier1.G[:, idx]
        coef = np.concatenate([g1, gf16.mat_mul(self.tier2.G, g1)])
        be.delta_update(a + b, olds, news, coef, self.page_bytes)

    def update_tier2(self, p2: Pages, index, old: Pages, new: Pages) -> None:
        """Tier-1 pages `index` changed from `old` to `new`: patch tier 2."""
        self.tier2.update(p2, index, old, new)

    def decode(self, data: Sequence[Optional[torch.Tensor]], p1: Sequence[Optional[torch.Tensor]],
               p2: Sequence[Optional[torch.Tensor]]) -> Recovery:
        """Rebuild every page given as None.  Decides the plan first and raises TooManyErasures
        (computing nothing) when no plan works."""
        data, p1, p2 = list(data), list(p1), list(p2)
        ld = [j for j, p in enumerate(data) if p is None]
        l1 = [j for j, p in enumerate(p1) if p is None]
        l2 = [j for j, p in enumerate(p2) if p is None]
        direct = len(ld) + len(l1) <= self.H1
        via_tier2 = bool(l1) and len(l1) + len(l2) <= self.H2 and len(ld) <= self.H1
        if not (direct or via_tier2):
            lost = ld + [self.D + j for j in l1] + [self.D + self.H1 + j for j in l2]
            raise TooManyErasures(lost, self.H1 + self.H2,
                                  f"{len(ld)} data + {len(l1)} tier-1 + {len(l2)} tier-2 pages lost")
        rec1: dict = {}
        rec2: dict = {}
        if not direct:  # tier 2 first: it rebuilds the lost tier-1 (and tier-2) pages
            r = self.tier2.decode(p1 + p2)
            for pos, page in r.items():
                (rec1 if pos < self.H1 else rec2)[pos if pos < self.H1 else pos - self.H1] = page
            p1 = [rec1.get(j, p) for j, p in enumerate(p1)]
            p2 = [rec2.get(j, p) for j, p in enumerate(p2)]
        r = self.tier1.decode(data + p1)
        recd = {pos: page for pos, page in r.items() if pos < self.D}
        for pos, page in r.items():
            if pos >= self.D:
                rec1[pos - self.D] = page
        p1 = [rec1.get(j, p) for j, p in enumerate(p1)]
        if any(p is None for p in p2):  # every tier-1 page is present now
            r = self.tier2.decode(p1 + p2)
            rec2.update({pos - self.H1: page for pos, page in r.items()})
        return Recovery(recd, rec1, rec2)

    def scrub(self, data: Pages, p1: Pages, p2: Pages, **kw) -> tuple[ScrubReport, ScrubReport]:
        """(tier-1 report over data + p1, tier-2 report over p1 + p2)."""
        d, _ = _as_pages(data, self.D, self.page_bytes, "data")
        a, _ = _as_pages(p1, self.H1, self.page_bytes, "p1")
        b, _ = _as_pages(p2, self.H2, self.page_bytes, "p2")
        return self.tier1.scrub(d + a, **kw), self.tier2.scrub(a + b, **kw)
