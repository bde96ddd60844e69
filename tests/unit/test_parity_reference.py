"""NumPy reference backend against the independent `galois` oracle, and the codec's behaviour
(delta update = re-encode, erasure decoding, scrub) on the reference backend."""
from __future__ import annotations

import galois
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leto_runtime.parity import ParityCode, ProtectionGroup, TooManyErasures, gf16, reference

GF = galois.GF(2**16, irreducible_poly=0x1002D)
KiB = 1 << 10
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def fill(kind: str, n: int, S: int, seed: int = 0) -> np.ndarray:
    if kind == "random":
        return np.random.default_rng(seed).integers(0, 256, (n, S), dtype=np.uint8)
    if kind == "zeros":
        return np.zeros((n, S), dtype=np.uint8)
    if kind == "ones":
        return np.full((n, S), 255, dtype=np.uint8)
    return ((np.arange(n)[:, None] * 7 + np.arange(S)[None, :]) % 251).astype(np.uint8)


def galois_parity(data: np.ndarray, m: int) -> np.ndarray:
    """Parity by the definition: G = H_P^-1 H_D over galois' GF(2^16), applied per symbol."""
    k = data.shape[0]
    x = GF(2)
    H = GF([[int(x ** ((j * t) % 65535)) for j in range(k + m)] for t in gf16.exponents(m)])
    G = np.linalg.inv(H[:, k:]) @ H[:, :k]
    return gf16.from_symbols(np.array(G @ GF(gf16.to_symbols(data).astype(np.int64))).astype(np.uint16))


@pytest.mark.parametrize("kind", ["random", "zeros", "ones", "structured"])
@pytest.mark.parametrize("k,m,S", [(8, 4, 4 * KiB), (16, 1, 2 * KiB), (5, 3, KiB), (12, 16, 2 * KiB), (1, 2, KiB)])
def test_reference_encode_matches_galois(kind, k, m, S):
    d = fill(kind, k, S, seed=k + m)
    got = ParityCode(k, m, S, backend="reference").encode(torch.from_numpy(d))
    assert np.array_equal(got.numpy(), galois_parity(d, m))


def test_codewords_have_zero_syndromes():
    d = fill("random", 9, 2 * KiB)
    code = ParityCode(9, 5, 2 * KiB, backend="reference")
    p = code.encode(torch.from_numpy(d))
    assert not code.syndromes(list(torch.from_numpy(d)) + list(p)).any()


@SETTINGS
@given(k=st.integers(1, 12), m=st.integers(1, 6), seed=st.integers(0, 2**31), data=st.data())
def test_delta_update_equals_reencode(k, m, seed, data):
    S = KiB
    code = ParityCode(k, m, S, backend="reference")
    d = torch.from_numpy(fill("random", k, S, seed))
    p = code.encode(d)
    for rnd in range(3):  # repeated updates, single pages and batches
        idx = sorted(data.draw(st.sets(st.integers(0, k - 1), min_size=1, max_size=k)))
        new = torch.from_numpy(fill("random", len(idx), S, seed + rnd + 1))
        code.update(p, idx, d[idx].clone(), new)
        d[idx] = new
        assert torch.equal(p, code.encode(d))


@SETTINGS
@given(k=st.integers(1, 20), m=st.integers(1, 8), seed=st.integers(0, 2**31), data=st.data())
def test_decode_any_m_erasures(k, m, seed, data):
    S = KiB
    code = ParityCode(k, m, S, backend="reference")
    d = torch.from_numpy(fill("random", k, S, seed))
    pages = list(d) + list(code.encode(d))
    e = data.draw(st.integers(1, m))
    lost = sorted(data.draw(st.sets(st.integers(0, k + m - 1), min_size=e, max_size=e)))
    rec = code.decode([None if j in lost else p for j, p in enumerate(pages)])
    assert sorted(rec) == lost and all(torch.equal(rec[j], pages[j]) for j in lost)


def test_decode_too_many_raises_and_writes_nothing():
    code = ParityCode(8, 4, KiB, backend="reference")
    d = torch.from_numpy(fill("random", 8, KiB))
    pages = list(d) + list(code.encode(d))
    out = {j: torch.full((KiB,), 7, dtype=torch.uint8) for j in range(5)}
    with pytest.raises(TooManyErasures) as ei:
        code.decode([None] * 5 + pages[5:], out=out)
    assert ei.value.lost == (0, 1, 2, 3, 4) and ei.value.tolerance == 4
    assert all((o == 7).all() for o in out.values())


def test_two_tier_group_on_reference():
    grp = ProtectionGroup(10, 4, 2, KiB, backend="reference")
    d = torch.from_numpy(fill("random", 10, KiB, 3))
    p1, p2 = grp.encode(d)
    assert torch.equal(p2, ParityCode(4, 2, KiB, backend="reference").encode(p1))
    # 4 data + 2 tier-1 lost: tier 2 repairs the tier-1 pages, then tier 1 the data.
    data = [None if j < 4 else x for j, x in enumerate(d)]
    rec = grp.decode(data, [None, None, p1[2], p1[3]], list(p2))
    assert all(torch.equal(rec.data[j], d[j]) for j in range(4))
    assert torch.equal(rec.tier1[0], p1[0]) and torch.equal(rec.tier1[1], p1[1])


@SETTINGS
@given(seed=st.integers(0, 2**31), data=st.data())
def test_locate_up_to_m_over_2_corrupted_pages(seed, data):
    """With m=8 syndromes, up to 4 pages corrupted at the same symbol position are located."""
    k, m, S = 24, 8, KiB
    d = fill("random", k, S, seed)
    code = ParityCode(k, m, S, backend="reference")
    pages = np.concatenate([d, code.encode(torch.from_numpy(d)).numpy()])
    nbad = data.draw(st.integers(1, m // 2))
    bad = sorted(data.draw(st.sets(st.integers(0, k + m - 1), min_size=nbad, max_size=nbad)))
    sym = gf16.to_symbols(pages)
    s = data.draw(st.integers(0, S // 2 - 1))
    for j in bad:
        sym[j, s] ^= data.draw(st.integers(1, 65535))
    corrupted = torch.from_numpy(gf16.from_symbols(sym))
    rep = code.scrub(list(corrupted))
    assert not rep.consistent and rep.bad_symbols == 1 and rep.unlocated == 0
    assert rep.suspects == {j: 1 for j in bad}


def test_berlekamp_massey_finds_a_known_lfsr():
    # s_n = a*s_{n-1} + b*s_{n-2}: connection polynomial 1 + a z + b z^2 (char. 2: minus = plus).
    a, b = 1234, 4321
    s = [1, 7]
    for _ in range(6):
        s.append(gf16.mul(a, s[-1]) ^ gf16.mul(b, s[-2]))
    assert reference.berlekamp_massey(s) == [1, a, b]
