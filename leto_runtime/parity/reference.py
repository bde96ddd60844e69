"""NumPy reference backend: the always-available path and the oracle for the C++/CUDA kernels.

Role: compute the primitives every backend offers, straight from docs/PARITY.md, on (n, S) uint8
arrays (or lists with None for a missing / all-zero page):

* ``syndrome_mix(pages, coef, ts)`` -> ``coef @ [sum_j x^(j t) page_j for t in ts]``.  Encode,
  decode and scrub are all this one primitive with different host-computed ``coef`` (see
  ``code.py``).  Syndromes use the Horner form of docs/PARITY.md on bit-planes: multiplying by x is
  a renaming of the 16 plane arrays plus three XORs, so the bulk work is whole-array XORs.  The
  small ``coef`` mix runs in the symbol domain with log/antilog tables - a deliberately different
  computation from the kernels' bitsliced shift-xor mix.
* ``delta_update(parity, coef, olds, news)`` -> ``parity_i ^= sum_l coef[i][l] * (old_l ^ new_l)``
  in the symbol domain (docs/PARITY.md "Delta update"), in place.

Calling contract: arrays are C-contiguous uint8 with a page size that is a multiple of 1024; the
functions never keep references to their inputs.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import gf16

Page = Optional[np.ndarray]


def _planes_doubled(page: np.ndarray) -> np.ndarray:
    """Page bytes -> (32, W) uint64: its 16 bit-planes (plane r of every block, in order), twice.

    Doubling lets a rotated view of the planes be a plain slice (no copy) in ``syndromes``.
    """
    nb = page.size // gf16.BLOCK_BYTES
    out = np.empty((32, nb * 8), dtype=np.uint64)
    out[:16] = page.view(np.uint64).reshape(nb, 16, 8).transpose(1, 0, 2).reshape(16, nb * 8)
    out[16:] = out[:16]
    return out


def _unplanes(planes: np.ndarray) -> np.ndarray:
    nb = planes.shape[1] // 8
    return np.ascontiguousarray(planes.reshape(16, nb, 8).transpose(1, 0, 2)).reshape(-1).view(np.uint8)


class _Acc:
    """Horner accumulator for one t: 16 plane arrays, logical plane r stored in row (r+off)%16.

    Multiplying by x renames planes (off -= 1) - the rotation costs nothing - and then folds the
    plane that wrapped around: x^16 = x^5 + x^3 + x^2 + 1, x^-1 = x^15 + x^4 + x^2 + x.
    """

    def __init__(self, words: int):
        self.a = np.zeros((16, words), dtype=np.uint64)
        self.off = 0

    def _row(self, r: int) -> np.ndarray:
        return self.a[(r + self.off) % 16]

    def mul_x(self) -> None:
        self.off -= 1                      # new plane r = old plane r-1; new plane 0 = old 15
        low = self._row(0)
        for r in (2, 3, 5):
            np.bitwise_xor(self._row(r), low, out=self._row(r))

    def mul_xinv(self) -> None:
        self.off += 1                      # new plane r = old plane r+1; new plane 15 = old 0
        high = self._row(15)
        for r in (1, 2, 4):
            np.bitwise_xor(self._row(r), high, out=self._row(r))

    def add(self, doubled: np.ndarray) -> None:
        o = self.off % 16                  # row p holds logical plane (p - off) % 16
        np.bitwise_xor(self.a, doubled[16 - o:32 - o], out=self.a)

    def planes(self) -> np.ndarray:
        return np.roll(self.a, -(self.off % 16), axis=0)


def syndromes(pages: Sequence[Page], ts: Sequence[int], page_bytes: int) -> list[np.ndarray]:
    """S_t = sum_j x^(j t) * page_j for each t, as page arrays (None pages count as zero)."""
    gf16.check_page_bytes(page_bytes)
    accs = [_Acc(page_bytes // 128) for _ in ts]
    for j in range(len(pages) - 1, -1, -1):            # Horner: acc = acc * x^t + c_j
        dbl = None
        if pages[j] is not None:
            dbl = _planes_doubled(np.ascontiguousarray(pages[j]).reshape(-1))
        for t, acc in zip(ts, accs):
            for _ in range(abs(t)):
                acc.mul_x() if t > 0 else acc.mul_xinv()
            if dbl is not None:
                acc.add(dbl)
    return [_unplanes(acc.planes()) for acc in accs]


def mix(coef: np.ndarray, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """out_i = sum_c coef[i][c] * inputs_c, symbol-wise, via log/antilog tables. (rows, S) uint8."""
    sym = gf16.to_symbols(np.stack(inputs))
    out = np.zeros((coef.shape[0], sym.shape[1]), dtype=np.uint16)
    for c in range(coef.shape[1]):
        logs = gf16.LOGZ[sym[c]]
        for i in range(coef.shape[0]):
            if coef[i, c] == 1:
                out[i] ^= sym[c]
            elif coef[i, c]:
                out[i] ^= gf16.mul_logs(int(coef[i, c]), logs)
    return gf16.from_symbols(out)


def syndrome_mix(pages: Sequence[Page], coef: np.ndarray, ts: Sequence[int],
                 page_bytes: int) -> np.ndarray:
    """coef (rows x len(ts)) times the syndromes S_t, t in ts. Returns (rows, S) uint8."""
    return mix(np.asarray(coef, dtype=np.uint16), syndromes(pages, ts, page_bytes))


def delta_update(parity: Sequence[np.ndarray], coef: np.ndarray, olds: Sequence[np.ndarray],
                 news: Sequence[Page]) -> None:
    """parity_i ^= sum_l coef[i][l] * (olds_l ^ news_l), in place (news_l None: olds_l is the delta)."""
    deltas = [o if n is None else np.bitwise_xor(o, n) for o, n in zip(olds, news)]
    delta = mix(np.asarray(coef, dtype=np.uint16), deltas)
    for i, p in enumerate(parity):
        np.bitwise_xor(p, delta[i], out=p)


# ---- scrub: locate silent corruption (Berlekamp-Massey per symbol position) ---------------
def berlekamp_massey(s: Sequence[int]) -> list[int]:
    """Shortest LFSR (connection polynomial, lowest degree first) generating the sequence s."""
    C, B = [1], [1]
    L, shift, b = 0, 1, 1
    for n in range(len(s)):
        d = s[n]
        for i in range(1, L + 1):
            if i < len(C) and C[i]:
                d ^= gf16.mul(C[i], s[n - i])
        if d == 0:
            shift += 1
            continue
        coef = gf16.mul(d, gf16.inv(b))
        T = C[:]
        C = C + [0] * max(0, len(B) + shift - len(C))
        for i, bi in enumerate(B):
            if bi:
                C[i + shift] ^= gf16.mul(coef, bi)
        if 2 * L <= n:
            L, B, b, shift = n + 1 - L, T, d, 1
        else:
            shift += 1
    return C[:L + 1] + [0] * max(0, L + 1 - len(C))


def locate(synd: Sequence[int], ts: Sequence[int], n_positions: int) -> Optional[list[int]]:
    """Positions j whose symbols explain the syndromes S_t = sum_j x^(j t) e_j, or None.

    Works for up to floor(len(ts)/2) corrupted positions; returns None when the syndromes are
    not explained by that many (more corruption than the code can locate).
    """
    # S_{lo+u} = sum_j (x^(j lo) e_j) (x^j)^u: a standard BCH syndrome sequence in X_j = x^j.
    lam = berlekamp_massey(list(synd))
    deg = len(lam) - 1
    if deg == 0 or deg > len(ts) // 2:
        return None
    j = np.arange(n_positions)
    val = np.zeros(n_positions, dtype=np.uint16)
    for i, c in enumerate(lam):       # Lambda(X_j^-1) = 0 at the error positions
        if c:
            val ^= gf16.mul(c, gf16.EXP[np.mod(-i * j, gf16.ORDER)].astype(np.uint16))
    roots = [int(x) for x in np.nonzero(val == 0)[0]]
    if len(roots) != deg:
        return None
    # Confirm: the error values must reproduce every syndrome (guards against mislocation).
    A = gf16.EXP[np.mod(np.outer(np.asarray(ts), np.asarray(roots)), gf16.ORDER)].astype(np.uint16)
    try:
        e = gf16.mat_mul(gf16.mat_inv(A[:deg]), np.asarray(synd[:deg], dtype=np.uint16)[:, None])
    except ZeroDivisionError:
        return None
    if not np.array_equal(gf16.mat_mul(A, e)[:, 0], np.asarray(synd, dtype=np.uint16)):
        return None
    return roots
