"""Delta updates of a contiguous run of data pages through the syndrome (encode) kernel.

Role: docs/PARITY.md's delta rule, p_i ^= sum_j G[i][j] (old_j ^ new_j), computed two ways.

* ``pagewise``: the backends' ``delta_update`` kernel - one run-time GF multiply per (parity page,
  changed page) pair: cost ~ rows x count page-multiplies.  Works for any index set.
* ``syndrome``: for a run j = first .. first+count-1, by linearity and G = M H_D,

      delta_p_i = sum_t (M[i][t] x^(first t)) S'_t,   S'_t = sum_{j'<count} x^(j' t) (old ^ new)_j',

  i.e. materialize D = old ^ new (one XOR pass; into a buffer the caller may lend), run the
  encode primitive ``syndrome_mix`` over D's pages - whose positions start at 0 - with the shifted
  coefficient matrix M' = M diag(x^(first t)) into a temp (rows x page), and XOR that into the
  parity.  Cost ~ count Horner steps (all m syndromes of one page together cost about one
  page-multiply on the GPU, two on the CPU) plus the rows x m run-time mix of the syndromes,
  a fixed ~rows x m page-multiplies: the path pays once the run is longer than about m pages.

GF arithmetic is exact, so both give the bytes of a full re-encode.  ``choose`` (pure) picks
the cheaper one from per-backend cost constants (see COSTS for where they come from).
LETO_PARITY_DELTA forces one.  ``run_scale`` gives the same shift as a per-syndrome scale, which
the CUDA kernel applies itself (code.update_delta_many: the code's own, compiled-in matrix).

Calling contract: ``syndrome_delta`` takes validated pages (code.py checks them), queues work on
the current CUDA stream for CUDA pages, and never synchronizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import torch

from . import gf16

from leto_runtime.wire import settings

METHODS = ("auto", "pagewise", "syndrome")


@dataclass(frozen=True)
class DeltaCosts:
    """Cost constants of one backend, in page-multiplies (one run-time GF constant times one
    page accumulated by the pagewise ``delta_update`` kernel).  Page-size independent (all work
    is per byte), so one set per backend."""

    pagewise_fixed: float   # per pagewise call: parity pages read + written, launch
    horner: float           # one delta page through the syndrome Horner with 16 exponents
    mix: float              # one (output row, exponent) pair of the run-time mix epilogue
    xor: float              # materializing one delta page (old ^ new: read 2, write 1)
    fold: float             # XOR of one temp row into a parity page
    fixed: float            # per syndrome call: extra launches / allocation


# The syndrome path on CUDA is checked bit for bit against pagewise and full re-encoding by
# tests/gpu/test_rmu_fused_gpu.py.  False sends CUDA back to the pagewise kernel (an escape
# hatch; LETO_PARITY_DELTA forces either).
CUDA_AUTO = True

# Relative costs per unit of work (one page multiply = 1), from benchmarks/parity_bench.py's
# "delta" rows; the measurements they come from: docs/BENCHMARKS.md, "Parity delta cost model".
COSTS = {
    "cpu": DeltaCosts(pagewise_fixed=0.0, horner=1.8, mix=0.9, xor=1.6, fold=0.65, fixed=10.0),
    "reference": DeltaCosts(pagewise_fixed=0.0, horner=0.6, mix=1.0, xor=0.1, fold=0.1, fixed=2.0),
    "cuda": DeltaCosts(pagewise_fixed=61.0, horner=1.9, mix=1.6, xor=1.4, fold=1.4, fixed=9.0),
}


def method_from_env(method: str) -> str:
    """'auto' defers to LETO_PARITY_DELTA (auto | pagewise | syndrome: tests, benchmarks, A/B)."""
    return settings.get().parity_delta if method == "auto" else method


@dataclass(frozen=True)
class DeltaPlan:
    method: str               # "pagewise" or "syndrome"
    first: Optional[int]      # start of the run (syndrome only)
    count: int
    reason: str
    cost_pagewise: float = 0.0
    cost_syndrome: float = 0.0


def run_start(index: Sequence[int]) -> Optional[int]:
    """`first` when index is first, first+1, ..., first+count-1 (ascending, no gaps), else None."""
    if not index:
        return None
    first = index[0]
    for off, j in enumerate(index):
        if j != first + off:
            return None
    return first


def choose(backend: str, m: int, rows: int, index: Sequence[int], *, have_delta: bool = False,
           method: str = "auto") -> DeltaPlan:
    """Pure: how to apply a delta of data pages `index` to `rows` parity pages of an m-parity code.

    backend: 'cpu' | 'cuda' | 'reference'.  have_delta: the caller gives old ^ new (no XOR pass).
    method: 'auto' (cheaper by COSTS), or force 'pagewise' / 'syndrome' (tests, benchmarks; a
    forced 'syndrome' on a non-contiguous index set falls back to pagewise, with the reason).
    """
    if method not in METHODS:
        raise ValueError(f"delta method must be one of {METHODS}, got {method!r}")
    count = len(index)
    first = run_start(index)
    if first is None:
        return DeltaPlan("pagewise", None, count, "the changed pages are not one ascending contiguous run")
    c = COSTS.get(backend, COSTS["reference"])
    n_t = len(gf16.exponents(m))
    pagewise = c.pagewise_fixed + count * rows
    syndrome = (c.fixed + count * (c.horner * n_t / 16 + (0.0 if have_delta else c.xor))
                + rows * (n_t * c.mix + c.fold))
    if method != "auto":
        return DeltaPlan(method, first if method == "syndrome" else None, count, f"forced {method}",
                         pagewise, syndrome)
    if backend == "cuda" and not CUDA_AUTO:
        return DeltaPlan("pagewise", None, count, "syndrome path switched off on CUDA "
                         "(delta.CUDA_AUTO; LETO_PARITY_DELTA=syndrome forces it)", pagewise, syndrome)
    if syndrome < pagewise:
        why = (f"contiguous run of {count} pages: syndrome path ~{syndrome:.0f} < pagewise ~{pagewise:.0f} "
               f"page-multiplies ({backend})")
        return DeltaPlan("syndrome", first, count, why, pagewise, syndrome)
    why = (f"run of {count} pages too short: pagewise ~{pagewise:.0f} <= syndrome path ~{syndrome:.0f} "
           f"page-multiplies ({backend}; the {rows}x{n_t} mix is a fixed cost)")
    return DeltaPlan("pagewise", None, count, why, pagewise, syndrome)


@lru_cache(maxsize=1024)
def run_scale(m: int, first: int) -> np.ndarray:
    """x^(first t) for t in T(m): the syndromes of a run at `first` are those of the same pages
    at position 0 times these (the diagonal of shifted_encode_matrix's shift; read-only)."""
    out = gf16.EXP[np.mod(first * np.asarray(gf16.exponents(m), dtype=np.int64), gf16.ORDER)].astype(np.uint16)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=1024)
def shifted_encode_matrix(k: int, m: int, first: int) -> np.ndarray:
    """M' = M diag(x^(first t)), t in T(m): delta parity of pages first.. = M' * S' (read-only)."""
    M = gf16.encode_matrix(k, m)
    shift = gf16.EXP[np.mod(first * np.asarray(gf16.exponents(m), dtype=np.int64), gf16.ORDER)]
    out = gf16.mul(M, shift[None, :].astype(np.uint16))
    out.flags.writeable = False
    return out


@lru_cache(maxsize=1024)
def shifted_group_matrix(D: int, H1: int, H2: int, first: int) -> np.ndarray:
    """[M1'; G2 M1'] ((H1 + H2) x H1): both tiers' delta from the tier-1 syndromes (read-only)."""
    m1 = shifted_encode_matrix(D, H1, first)
    out = np.concatenate([m1, gf16.mat_mul(gf16.generator(H1, H2), m1)])
    out.flags.writeable = False
    return out


def u8(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor of any dtype (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _buffer(scratch: Optional[torch.Tensor], offset: int, nbytes: int, device) -> torch.Tensor:
    """nbytes of uint8 from scratch[offset:] when it is large enough, else a new allocation."""
    if scratch is not None:
        flat = u8(scratch)
        if flat.numel() >= offset + nbytes:
            return flat[offset:offset + nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def materialize(olds: Sequence[torch.Tensor], news: Sequence[Optional[torch.Tensor]],
                old_stacked: Optional[torch.Tensor], new_stacked: Optional[torch.Tensor],
                page_bytes: int, scratch: Optional[torch.Tensor], device) -> tuple[list, int]:
    """The delta pages D_l = old_l ^ new_l (or olds themselves when news are None).

    Returns (pages, bytes of scratch used).  Stacked inputs take one XOR over the whole run.
    """
    count = len(olds)
    if all(n is None for n in news):
        return list(olds), 0
    buf = _buffer(scratch, 0, count * page_bytes, device)
    if old_stacked is not None and new_stacked is not None:
        torch.bitwise_xor(u8(old_stacked), u8(new_stacked), out=buf)
    else:
        for l, (o, n) in enumerate(zip(olds, news)):
            dst = buf[l * page_bytes:(l + 1) * page_bytes]
            if n is None:
                dst.copy_(u8(o))
            else:
                torch.bitwise_xor(u8(o), u8(n), out=dst)
    return list(buf.view(count, page_bytes)), count * page_bytes


def syndrome_delta(be, targets: Sequence[tuple[object, int]], coef: np.ndarray, ts: Sequence[int],
                   deltas: Sequence[torch.Tensor], page_bytes: int, *,
                   scratch: Optional[torch.Tensor] = None, scratch_used: int = 0,
                   bases: Optional[Sequence[object]] = None, max_outputs: Optional[int] = None,
                   tier2: Optional[tuple[np.ndarray, tuple[int, ...]]] = None) -> None:
    """Patch parity with coef (rows x len(ts)) times the syndromes S'_t of `deltas`.

    targets: [(parity, rows)] - parity is a stacked (rows, page) tensor or a list of page
    tensors; the rows of coef are split over them in order.  bases: per target, None (parity ^=
    delta, in place) or a tensor like parity (parity = base ^ delta; parity is only written).
    tier2: (G2 mix, exponents) when the last target's rows are G2 times the first target's
    delta and the backend takes fewer than sum(rows) outputs per call (CUDA: 16): then the
    second target is computed as a tier-2 encode of the first one's delta.
    """
    rows = sum(r for _, r in targets)
    bases = list(bases) if bases is not None else [None] * len(targets)
    device = deltas[0].device
    if max_outputs is not None and rows > max_outputs:
        if tier2 is None or len(targets) != 2:
            raise ValueError(f"{rows} outputs exceed the backend's {max_outputs} per call")
        (p1, r1), (p2, r2) = targets
        t1 = _buffer(scratch, scratch_used, r1 * page_bytes, device).view(r1, page_bytes)
        be.syndrome_mix(deltas, list(t1), coef[:r1], ts, page_bytes)
        t2 = _buffer(scratch, scratch_used + r1 * page_bytes, r2 * page_bytes, device).view(r2, page_bytes)
        be.syndrome_mix(list(t1), list(t2), tier2[0], tier2[1], page_bytes)
        _fold(p1, t1, bases[0])
        _fold(p2, t2, bases[1])
        return
    # Where the outputs can go straight into the parity (parity = base ^ delta), skip the temp.
    direct = all(b is not None for b in bases)
    if direct:
        outs = []
        for p, _ in targets:
            outs += _pages(p, page_bytes)
        be.syndrome_mix(deltas, outs, coef, ts, page_bytes)
        for (p, r), b in zip(targets, bases):
            _fold_into(p, b, page_bytes)
        return
    tmp = _buffer(scratch, scratch_used, rows * page_bytes, device).view(rows, page_bytes)
    be.syndrome_mix(deltas, list(tmp), coef, ts, page_bytes)
    r0 = 0
    for (p, r), b in zip(targets, bases):
        _fold(p, tmp[r0:r0 + r], b)
        r0 += r


def _pages(p, page_bytes: int) -> list[torch.Tensor]:
    if isinstance(p, torch.Tensor):
        return list(u8(p).view(-1, page_bytes))
    return list(p)


def _fold(parity, tmp: torch.Tensor, base) -> None:
    """parity ^= tmp (base None) or parity = base ^ tmp; tmp is (rows, page) uint8."""
    if isinstance(parity, torch.Tensor):
        dst = u8(parity)
        src = u8(base) if base is not None else dst
        torch.bitwise_xor(src, tmp.reshape(-1), out=dst)
        return
    bl = [None] * len(parity) if base is None else _pages(base, tmp.shape[1])
    for p, t, b in zip(parity, tmp, bl):
        dst = u8(p)
        torch.bitwise_xor(dst if b is None else u8(b), t, out=dst)


def _fold_into(parity, base, page_bytes: int) -> None:
    """parity ^= base (parity already holds the delta)."""
    if isinstance(parity, torch.Tensor) and isinstance(base, torch.Tensor):
        u8(parity).bitwise_xor_(u8(base))
        return
    for p, b in zip(_pages(parity, page_bytes), _pages(base, page_bytes)):
        u8(p).bitwise_xor_(u8(b))
