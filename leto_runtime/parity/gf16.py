"""GF(2^16) arithmetic and the code's matrices, exactly as docs/PARITY.md fixes them.

Role: the single Python definition of the field (polynomial 0x1002D), of the parity-check matrix
H, the systematic generator G = H_P^-1 * H_D, the decode matrices, and the bitsliced page layout.
Every backend (NumPy reference, C++ and CUDA kernels) takes its coefficients from here, so the
kernels only ever compute "syndromes, then mix with a small host-computed matrix".

Calling contract: all functions are pure; elements are Python ints or NumPy uint16 arrays.
Tables are built once at import (about 20 ms).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

POLY = 0x1002D          # x^16 + x^5 + x^3 + x^2 + 1 (primitive)
ORDER = 0xFFFF          # multiplicative order of x
BLOCK_BYTES = 1024      # one block = 16 planes of 64 bytes = 512 symbols
SYMBOLS_PER_BLOCK = 512
T_LO_MIN, T_HI_MAX = -7, 8   # T(m) for every m <= 16 lies in this window (the kernels' window)
KERNEL_T = tuple(range(T_LO_MIN, T_HI_MAX + 1))


def _build_tables() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(2 * ORDER, dtype=np.uint32)
    log = np.zeros(1 << 16, dtype=np.uint32)
    a = 1
    for i in range(ORDER):
        exp[i] = a
        log[a] = i
        a <<= 1
        if a & 0x10000:
            a ^= POLY
    if a != 1:  # x must have order exactly 65535, or the code is not what docs/PARITY.md says
        raise AssertionError("0x1002D is not primitive?")
    exp[ORDER:] = exp[:ORDER]  # so exp[log a + log b] needs no modulo
    return exp, log


EXP, LOG = _build_tables()


# ---- scalar and vector arithmetic --------------------------------------------------------
def mul(a, b):
    """Product of elements (ints or uint16 arrays, broadcasting)."""
    a = np.asarray(a, dtype=np.uint32)
    b = np.asarray(b, dtype=np.uint32)
    r = EXP[LOG[a] + LOG[b]]
    r = np.where((a == 0) | (b == 0), 0, r)
    return r.astype(np.uint16) if r.ndim else int(r)


def inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^16)")
    return int(EXP[(ORDER - LOG[a]) % ORDER])


def xpow(e: int) -> int:
    """x^e for any integer e (negative allowed)."""
    return int(EXP[e % ORDER])


# Zero-aware tables for bulk products: LOGZ[0] points into an all-zero tail of EXPZ, so
# c * v = EXPZ[LOGZ[v] + LOG[c]] for every v (one add and one gather, no masking).
EXPZ = np.concatenate([EXP, np.zeros(ORDER + 1, dtype=np.uint32)]).astype(np.uint16)
LOGZ = LOG.copy()
LOGZ[0] = 2 * ORDER


def mul_const(c: int, v: np.ndarray) -> np.ndarray:
    """c * v for a uint16 symbol array v (log/antilog tables)."""
    return mul_logs(c, LOGZ[v])


def mul_logs(c: int, logv: np.ndarray) -> np.ndarray:
    """c * v given logv = LOGZ[v] (lets a caller reuse the logs of v for many constants)."""
    if c == 0:
        return np.zeros(logv.shape, dtype=np.uint16)
    return EXPZ[logv + LOG[c]]


def mat_mul(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^16) (small matrices; uint16 in, uint16 out)."""
    A = np.asarray(A, dtype=np.uint16)
    B = np.asarray(B, dtype=np.uint16)
    out = np.zeros((A.shape[0], B.shape[1]), dtype=np.uint16)
    for i in range(A.shape[1]):
        out ^= mul(A[:, i:i + 1], B[i:i + 1, :])
    return out


def mat_inv(A: np.ndarray) -> np.ndarray:
    """Inverse by Gauss-Jordan; raises ZeroDivisionError when A is singular."""
    A = np.array(A, dtype=np.uint16)
    n = A.shape[0]
    aug = np.concatenate([A, np.eye(n, dtype=np.uint16)], axis=1)
    for col in range(n):
        nz = np.nonzero(aug[col:, col])[0]
        if nz.size == 0:
            raise ZeroDivisionError("singular matrix")
        piv = col + int(nz[0])
        if piv != col:
            aug[[col, piv]] = aug[[piv, col]]
        aug[col] = mul(inv(int(aug[col, col])), aug[col])
        f = aug[:, col].copy()
        f[col] = 0
        aug ^= mul(f[:, None], aug[col][None, :])
    return aug[:, n:]


# ---- the code's matrices -----------------------------------------------------------------
def exponents(m: int) -> tuple[int, ...]:
    """T(m) = {lo .. lo+m-1}, lo = -(ceil(m/2) - 1)."""
    lo = -((m + 1) // 2 - 1)
    return tuple(range(lo, lo + m))


def check_shape(k: int, m: int) -> None:
    if k < 1 or m < 1 or k + m > ORDER:
        raise ValueError(f"need k >= 1, m >= 1, k + m <= 65535 (got k={k}, m={m})")


def parity_check(k: int, m: int, positions=None) -> np.ndarray:
    """H[t][j] = x^(j*t) for t in T(m) and the given positions (default 0..k+m-1)."""
    check_shape(k, m)
    j = np.arange(k + m) if positions is None else np.asarray(positions)
    t = np.asarray(exponents(m))
    return EXP[np.mod(np.outer(t, j), ORDER)].astype(np.uint16)


@lru_cache(maxsize=64)
def encode_matrix(k: int, m: int) -> np.ndarray:
    """M = H_P^-1 (m x m): parity = M * syndromes-over-data. Read-only."""
    m_ = mat_inv(parity_check(k, m, positions=range(k, k + m)))
    m_.flags.writeable = False
    return m_


@lru_cache(maxsize=64)
def generator(k: int, m: int) -> np.ndarray:
    """Systematic generator G = M * H_D (m x k): parity_i = sum_j G[i][j] * d_j. Read-only."""
    g = mat_mul(encode_matrix(k, m), parity_check(k, m, positions=range(k)))
    g.flags.writeable = False
    return g


@lru_cache(maxsize=256)
def decode_matrix(k: int, m: int, lost: tuple[int, ...]) -> np.ndarray:
    """A^-1 for the lost positions, with A = H[R][L], R = the first e exponents of T(m).

    Recovered pages c_L = A^-1 * S_R, where S_t are the partial syndromes over the survivors.
    """
    e = len(lost)
    rows = np.asarray(exponents(m)[:e])
    A = EXP[np.mod(np.outer(rows, np.asarray(lost)), ORDER)].astype(np.uint16)
    a_inv = mat_inv(A)
    a_inv.flags.writeable = False   # cached: callers share it
    return a_inv


def kernel_mix(coef: np.ndarray, ts: tuple[int, ...]) -> np.ndarray:
    """Place an (outputs x len(ts)) coefficient matrix into the kernels' 16 columns t=-7..8."""
    if min(ts) < T_LO_MIN or max(ts) > T_HI_MAX:
        raise ValueError(f"exponents {ts} outside the kernels' window -7..8 (m > 16?)")
    out = np.zeros((coef.shape[0], len(KERNEL_T)), dtype=np.uint16)
    for c, t in enumerate(ts):
        out[:, t - T_LO_MIN] = coef[:, c]
    return out


# ---- bitsliced layout --------------------------------------------------------------------
def check_page_bytes(page_bytes: int) -> None:
    if page_bytes <= 0 or page_bytes % BLOCK_BYTES:
        raise ValueError(f"page size must be a positive multiple of 1024 bytes (got {page_bytes})")


def to_symbols(pages: np.ndarray) -> np.ndarray:
    """(n, S) uint8 pages -> (n, S/2) uint16 symbols, symbol s = 512*b + 64*w + i.

    Bit r of symbol s is bit i of little-endian word w of plane r of block b: unpacking a plane
    little-endian lists its 512 bits in symbol order, and packing the 16 plane bits of a symbol
    little-endian gives its two bytes.
    """
    n, S = pages.shape
    bits = np.unpackbits(pages.reshape(n, S // BLOCK_BYTES, 16, 64), axis=-1, bitorder="little")
    bits = np.ascontiguousarray(bits.transpose(0, 1, 3, 2))           # (n, nb, 512, 16)
    return np.packbits(bits, axis=-1, bitorder="little").view("<u2").reshape(n, S // 2)


def from_symbols(sym: np.ndarray) -> np.ndarray:
    """Inverse of to_symbols: (n, S/2) uint16 -> (n, S) uint8."""
    n, half = sym.shape
    nb = half // SYMBOLS_PER_BLOCK
    raw = np.ascontiguousarray(sym, dtype="<u2").reshape(n, nb, SYMBOLS_PER_BLOCK, 1).view(np.uint8)
    bits = np.unpackbits(raw, axis=-1, bitorder="little")            # (n, nb, 512, 16)
    bits = np.ascontiguousarray(bits.transpose(0, 1, 3, 2))
    return np.packbits(bits, axis=-1, bitorder="little").reshape(n, half * 2)
