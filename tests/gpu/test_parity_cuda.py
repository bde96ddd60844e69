"""CUDA parity kernels on a real GPU, against the NumPy reference and the C++ CPU kernels (which
tests/unit checks against the independent `galois` oracle).  Every kernel variant is covered:
the default (cp.async pipeline, compiled-in mix for k=1024/m=16), `nobake`, `nb2` (2-block
tiles) and `simple` (no pipeline).  Run on the lent H200: `pytest tests/gpu -q`."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leto_runtime.parity import ParityCode, ProtectionGroup, TooManyErasures, backends, gf16

KiB, MiB = 1 << 10, 1 << 20
VARIANTS = ("auto", "nobake", "plain", "nb2", "unrolled", "simple")
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def cuda_ops():
    ops = backends.cuda_backend()   # builds the extension on first use; a failure here is a failure
    yield ops
    ops.variant = "auto"


def pages(n: int, S: int, fill: str = "random", seed: int = 0, device="cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    if fill == "random":
        return torch.randint(0, 256, (n, S), dtype=torch.uint8, device=device, generator=g)
    if fill == "zeros":
        return torch.zeros((n, S), dtype=torch.uint8, device=device)
    if fill == "ones":
        return torch.full((n, S), 255, dtype=torch.uint8, device=device)
    # structured: page j holds bytes (j * 7 + i) % 251 - repeating, non-random, distinct per page
    i = torch.arange(S, device=device, dtype=torch.int64)
    j = torch.arange(n, device=device, dtype=torch.int64)[:, None]
    return ((j * 7 + i) % 251).to(torch.uint8)


def separate(t: torch.Tensor) -> list[torch.Tensor]:
    """Each page in its own allocation (as retained pages are)."""
    return [row.clone() for row in t]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fill", ["random", "zeros", "ones", "structured"])
@pytest.mark.parametrize("k,m,S", [(8, 4, 4 * KiB), (16, 1, 2 * KiB), (37, 16, 8 * KiB), (5, 3, KiB),
                                   (1, 1, KiB), (40, 9, 3 * KiB)])
def test_encode_matches_reference(cuda_ops, variant, fill, k, m, S):
    cuda_ops.variant = variant
    d = pages(k, S, fill, seed=k * 131 + m)
    got = ParityCode(k, m, S, backend="cuda").encode(separate(d))
    want = ParityCode(k, m, S, backend="reference").encode(d.cpu())
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_default_group_encode_is_exact(cuda_ops, variant):
    """D=1024, H1=16, H2=1, S=2 MiB (a 2 GiB group), pages in separate allocations."""
    cuda_ops.variant = variant
    grp = ProtectionGroup(1024, 16, 1, 2 * MiB, backend="cuda")
    data = [torch.randint(0, 256, (2 * MiB,), dtype=torch.uint8, device="cuda") for _ in range(1024)]
    p1, p2 = grp.encode(data)
    host = [d.cpu() for d in data]
    cpu = ProtectionGroup(1024, 16, 1, 2 * MiB, backend="cpu")
    q1, q2 = cpu.encode(host)
    assert torch.equal(p1.cpu(), q1) and torch.equal(p2.cpu(), q2)
    # And the reference on the first and last block (parity is symbol-wise, so blocks are independent).
    for lo in (0, 2 * MiB - KiB):
        ref = ParityCode(1024, 16, KiB, backend="reference").encode(torch.stack([h[lo:lo + KiB] for h in host]))
        assert torch.equal(p1.cpu()[:, lo:lo + KiB], ref)


def test_default_encode_takes_the_baked_path(cuda_ops):
    coef = gf16.kernel_mix(gf16.encode_matrix(1024, 16), gf16.exponents(16)).astype(np.int32)
    assert cuda_ops.ext.coef_is_baked(torch.from_numpy(coef))
    assert not cuda_ops.ext.coef_is_baked(torch.from_numpy(np.ascontiguousarray(coef[:8])))


@SETTINGS
@given(k=st.integers(1, 70), m=st.integers(1, 16), blocks=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_cuda_matches_cpu_kernels(cuda_ops, k, m, blocks, seed):
    cuda_ops.variant = "auto"
    S = blocks * KiB
    d = pages(k, S, seed=seed)
    got = ParityCode(k, m, S, backend="cuda").encode(d)
    assert torch.equal(got.cpu(), ParityCode(k, m, S, backend="cpu").encode(d.cpu()))


@pytest.mark.parametrize("k,m,S", [(1024, 16, 64 * KiB), (8, 4, 4 * KiB), (37, 16, 8 * KiB), (16, 1, KiB)])
def test_delta_update_equals_reencode(cuda_ops, k, m, S):
    cuda_ops.variant = "auto"
    code = ParityCode(k, m, S, backend="cuda")
    d = pages(k, S, seed=3)
    p = code.encode(d)
    rng = np.random.default_rng(k + m)
    for rnd in range(4):  # single pages, batches, and repeated updates of the same pages
        n = 1 if rnd < 2 else min(k, 5 * rnd)
        idx = sorted(rng.choice(k, size=n, replace=False).tolist())
        new = pages(n, S, seed=100 + rnd)
        code.update(p, idx, d[idx].clone(), new)
        d[idx] = new
        assert torch.equal(p, code.encode(d)), (rnd, idx)
    delta = pages(1, S, seed=7)
    code.update_delta(p, [0], delta)
    d[0] ^= delta[0]
    assert torch.equal(p, code.encode(d))


def test_group_update_patches_both_tiers(cuda_ops):
    grp = ProtectionGroup(64, 16, 2, 16 * KiB, backend="cuda")
    d = pages(64, 16 * KiB, seed=5)
    p1, p2 = grp.encode(d)
    new = pages(3, 16 * KiB, seed=6)
    grp.update(p1, p2, [0, 17, 63], d[[0, 17, 63]].clone(), new)
    d[[0, 17, 63]] = new
    q1, q2 = grp.encode(d)
    assert torch.equal(p1, q1) and torch.equal(p2, q2)


@pytest.fixture(scope="module")
def big_group(cuda_ops):
    """D=1024, H1=16, H2=1 with 16 KiB pages (the default shape, a smaller page)."""
    S = 16 * KiB
    grp = ProtectionGroup(1024, 16, 1, S, backend="cuda")
    d = pages(1024, S, seed=11)
    p1, p2 = grp.encode(d)
    return grp, d, p1, p2


@pytest.mark.parametrize("e", range(1, 17))
def test_decode_every_count_of_lost_data_pages(big_group, e):
    grp, d, p1, _ = big_group
    rng = np.random.default_rng(e)
    lost = sorted(rng.choice(1024, size=e, replace=False).tolist())
    pg = [None if j in lost else x for j, x in enumerate(list(d) + list(p1))]
    rec = grp.tier1.decode(pg)
    assert sorted(rec) == lost and all(torch.equal(rec[j], d[j]) for j in lost)


@SETTINGS
@given(data=st.data())
def test_decode_mixed_data_and_parity_losses(big_group, data):
    grp, d, p1, _ = big_group
    e = data.draw(st.integers(1, 16))
    lost = sorted(data.draw(st.sets(st.integers(0, 1024 + 15), min_size=e, max_size=e)))
    allp = list(d) + list(p1)
    rec = grp.tier1.decode([None if j in lost else x for j, x in enumerate(allp)])
    assert all(torch.equal(rec[j], allp[j]) for j in lost)


@pytest.mark.parametrize("start", [0, 500, 1008, 1024 - 8])
def test_decode_sixteen_consecutive_pages(big_group, start):
    """One failed DRAM row takes out 16 consecutive pages (possibly straddling data and parity)."""
    grp, d, p1, _ = big_group
    allp = list(d) + list(p1)
    lost = list(range(start, start + 16))
    rec = grp.tier1.decode([None if j in lost else x for j, x in enumerate(allp)])
    assert all(torch.equal(rec[j], allp[j]) for j in lost)


def test_tier2_repairs_a_lost_tier1_page_and_too_many_raise(big_group):
    grp, d, p1, p2 = big_group
    # 16 data pages and one tier-1 page lost: tier 1 alone cannot, tier 2 rebuilds the tier-1 page.
    ld = list(range(100, 116))
    data = [None if j in ld else x for j, x in enumerate(d)]
    t1 = [None if j == 5 else x for j, x in enumerate(p1)]
    rec = grp.decode(data, t1, list(p2))
    assert torch.equal(rec.tier1[5], p1[5]) and all(torch.equal(rec.data[j], d[j]) for j in ld)
    with pytest.raises(TooManyErasures):
        grp.tier1.decode([None] * 17 + list(d[17:]) + list(p1))
    with pytest.raises(TooManyErasures):  # 16 data + 2 tier-1 with H2=1: no plan works
        grp.decode(data, [None, None] + list(p1[2:]), list(p2))


@SETTINGS
@given(page=st.integers(0, 1024 + 15), byte=st.integers(0, 16 * KiB - 1), bit=st.integers(0, 7))
def test_scrub_flags_and_locates_a_single_flipped_bit(big_group, page, byte, bit):
    grp, d, p1, _ = big_group
    allp = list(d) + list(p1)
    bad = allp[page].clone()
    bad[byte] ^= 1 << bit
    rep = grp.tier1.scrub(allp[:page] + [bad] + allp[page + 1:])
    assert not rep.consistent and rep.bad_symbols == 1 and rep.suspects == {page: 1}


def test_scrub_consistent_group(big_group):
    grp, d, p1, p2 = big_group
    r1, r2 = grp.scrub(d, p1, p2)
    assert r1.consistent and r2.consistent


def test_runs_on_the_callers_stream(cuda_ops):
    code = ParityCode(64, 16, 64 * KiB, backend="cuda")
    d = pages(64, 64 * KiB, seed=9)
    want = code.encode(d)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = torch.empty_like(want)
        code.encode(d, out=out)
    side.synchronize()
    assert torch.equal(out, want)
