"""GF(2^16) helpers and the code's matrices against the independent `galois` oracle (docs/PARITY.md)."""
from __future__ import annotations

import galois
import numpy as np
import pytest

from leto_runtime.parity import gf16

GF = galois.GF(2**16, irreducible_poly=0x1002D)


def galois_H(k: int, m: int):
    x = GF(2)
    ts = gf16.exponents(m)
    return GF([[int(x ** ((j * t) % 65535)) for j in range(k + m)] for t in ts])


def galois_G(k: int, m: int):
    H = galois_H(k, m)
    return np.linalg.inv(H[:, k:]) @ H[:, :k]


def test_field_is_galois_field():
    assert GF.irreducible_poly == galois.Poly.Int(0x1002D) and GF.is_primitive_poly
    rng = np.random.default_rng(0)
    a = rng.integers(0, 65536, 2000)
    b = rng.integers(0, 65536, 2000)
    assert np.array_equal(gf16.mul(a, b), np.array(GF(a) * GF(b)))
    nz = a[a != 0][:50]
    assert [gf16.inv(int(v)) for v in nz] == [int(v) for v in GF(nz) ** -1]
    assert gf16.xpow(-1) == int(GF(2) ** -1) == 0b1000000000010110


def test_exponent_sets():
    assert gf16.exponents(16) == tuple(range(-7, 9))
    assert gf16.exponents(1) == (0,)
    assert gf16.exponents(4) == (-1, 0, 1, 2)
    assert gf16.exponents(3) == (-1, 0, 1)
    for m in range(1, 17):  # the kernels' window covers every m <= 16
        ts = gf16.exponents(m)
        assert len(ts) == m and min(ts) >= -7 and max(ts) <= 8


def test_parity_md_test_vector():
    assert gf16.generator(1024, 16)[0, :4].tolist() == [42716, 2356, 35424, 20074]
    assert (gf16.generator(16, 1) == 1).all()


@pytest.mark.parametrize("k,m", [(8, 4), (16, 1), (5, 3), (1, 1), (12, 16), (30, 7)])
def test_generator_matches_galois(k, m):
    assert np.array_equal(gf16.generator(k, m), np.array(galois_G(k, m)))


def test_generator_rows_of_default_code_match_galois():
    # The full 16 x 1024 default generator, column block by column block.
    G = gf16.generator(1024, 16)
    H = galois_H(1024, 16)
    Minv = np.linalg.inv(H[:, 1024:])
    assert np.array_equal(G[:, :64], np.array(Minv @ H[:, :64]))
    assert np.array_equal(G[:, -64:], np.array(Minv @ H[:, 1024 - 64:1024]))


def test_decode_matrix_inverts_the_lost_columns():
    k, m = 20, 6
    lost = (0, 7, 19, 21, 25)
    A = np.array(galois_H(k, m))[: len(lost)][:, list(lost)]
    assert np.array_equal(gf16.mat_mul(gf16.decode_matrix(k, m, lost), A), np.eye(len(lost), dtype=np.uint16))


def test_bitsliced_layout_is_the_normative_one():
    # Bit r of symbol s = 512*b + 64*w + i is bit i of little-endian word w of plane r of block b.
    S = 2048
    page = np.zeros(S, dtype=np.uint8)
    b, w, i, r = 1, 5, 37, 11
    word = np.zeros(1, dtype="<u8")
    word[0] = 1 << i
    off = 1024 * b + 64 * r + 8 * w
    page[off:off + 8] = word.view(np.uint8)
    sym = gf16.to_symbols(page[None])[0]
    s = 512 * b + 64 * w + i
    assert sym[s] == 1 << r and np.count_nonzero(sym) == 1
    rng = np.random.default_rng(1)
    p = rng.integers(0, 256, (3, 4096), dtype=np.uint8)
    assert np.array_equal(gf16.from_symbols(gf16.to_symbols(p)), p)


def test_shape_checks():
    with pytest.raises(ValueError):
        gf16.check_shape(65535, 1)
    with pytest.raises(ValueError):
        gf16.check_page_bytes(1000)
    with pytest.raises(ValueError):
        gf16.kernel_mix(np.ones((1, 1), dtype=np.uint16), (9,))
