"""C++ CPU kernels (cuda/parity_cpu.cpp) against galois and the NumPy reference, for every vector
ISA this CPU has (all must give identical bytes).  The extension is JIT-built once per session
(cached under ~/.cache/leto); the first build prints a progress message and takes about a minute."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leto_runtime.parity import ParityCode, ProtectionGroup, _ext, baked, gf16

from test_parity_reference import fill, galois_parity  # same directory (pytest puts it on sys.path)

KiB, MiB = 1 << 10, 1 << 20
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def ext():
    # Only a missing toolchain skips (with the reason); a compile error fails the tests.
    if _ext._compiler() is None:
        pytest.skip("no C++ compiler: the C++ kernels cannot be built here (reference tests still run)")
    try:
        import torch.utils.cpp_extension as cpp
        cpp.verify_ninja_availability()
    except RuntimeError:
        pytest.skip("ninja is not installed: pip install ninja")
    mod = _ext.load_cpu()
    yield mod
    mod.set_isa("auto")


def isas(ext) -> list[str]:
    best = ext.set_isa("auto")
    order = ["avx512", "avx2", "base"]
    return order[order.index(best):]


def separate(a: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(row.copy()) for row in a]  # one allocation per page


@pytest.mark.parametrize("kind", ["random", "zeros", "ones", "structured"])
@pytest.mark.parametrize("k,m,S", [(8, 4, 4 * KiB), (16, 1, 2 * KiB), (37, 16, 3 * KiB), (1, 1, KiB)])
def test_cpu_encode_matches_galois_on_every_isa(ext, kind, k, m, S):
    d = fill(kind, k, S, seed=k * 3 + m)
    want = galois_parity(d, m)
    for isa in isas(ext):
        ext.set_isa(isa)
        got = ParityCode(k, m, S, backend="cpu").encode(separate(d))
        assert np.array_equal(got.numpy(), want), isa


@pytest.mark.parametrize("k,m,h2,S", [(1024, 16, 1, 16 * KiB), (16, 16, 1, 2 * MiB), (64, 9, 2, 8 * KiB)])
def test_cpu_matches_reference_on_larger_shapes(ext, k, m, h2, S):
    """Default D=1024/H1=16/H2=1 (smaller pages) and the default 2 MiB page (fewer pages)."""
    d = torch.from_numpy(fill("random", k, S, seed=k))
    p1, p2 = ProtectionGroup(k, m, h2, S, backend="cpu").encode(d)
    for lo in (0, S - KiB):   # parity is symbol-wise: check the first and last block
        blk = d[:, lo:lo + KiB].contiguous()
        r1, r2 = ProtectionGroup(k, m, h2, KiB, backend="reference").encode(blk)
        assert torch.equal(p1[:, lo:lo + KiB], r1) and torch.equal(p2[:, lo:lo + KiB], r2)


@SETTINGS
@given(k=st.integers(1, 70), m=st.integers(1, 16), blocks=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_cpu_matches_reference_random_shapes(ext, k, m, blocks, seed):
    ext.set_isa("auto")
    S = blocks * KiB
    d = torch.from_numpy(fill("random", k, S, seed))
    got = ParityCode(k, m, S, backend="cpu").encode(d)
    assert torch.equal(got, ParityCode(k, m, S, backend="reference").encode(d))


@pytest.mark.parametrize("k,m", [(8, 4), (37, 16), (16, 1), (200, 16)])
def test_cpu_delta_update_equals_reencode(ext, k, m):
    S = 2 * KiB
    rng = np.random.default_rng(k)
    for isa in isas(ext):
        ext.set_isa(isa)
        code = ParityCode(k, m, S, backend="cpu")
        d = torch.from_numpy(fill("random", k, S, k))
        p = code.encode(d)
        for rnd in range(4):  # single, single again, batches (repeated pages allowed across rounds)
            n = 1 if rnd < 2 else min(k, 3 * rnd)
            idx = sorted(rng.choice(k, size=n, replace=False).tolist())
            new = torch.from_numpy(fill("random", n, S, 100 + rnd))
            code.update(p, idx, d[idx].clone(), new)
            d[idx] = new
            assert torch.equal(p, code.encode(d)), (isa, rnd)


def test_cpu_group_update_and_decode(ext):
    ext.set_isa("auto")
    S = 4 * KiB
    grp = ProtectionGroup(1024, 16, 1, S, backend="cpu")
    d = torch.from_numpy(fill("random", 1024, S, 9))
    p1, p2 = grp.encode(d)
    new = torch.from_numpy(fill("random", 2, S, 10))
    grp.update(p1, p2, [3, 900], d[[3, 900]].clone(), new)
    d[[3, 900]] = new
    q1, q2 = grp.encode(d)
    assert torch.equal(p1, q1) and torch.equal(p2, q2)
    lost = list(range(500, 516))   # 16 consecutive pages: one failed DRAM row
    rec = grp.decode([None if j in lost else x for j, x in enumerate(d)], list(p1), list(p2))
    assert all(torch.equal(rec.data[j], d[j]) for j in lost)
    data = [None if j in lost else x for j, x in enumerate(d)]
    rec = grp.decode(data, [None] + list(p1[1:]), list(p2))   # + a lost tier-1 page: tier 2 repairs it
    assert torch.equal(rec.tier1[0], p1[0]) and all(torch.equal(rec.data[j], d[j]) for j in lost)


def test_cpu_scrub_flags_one_flipped_bit(ext):
    code = ParityCode(40, 16, 2 * KiB, backend="cpu")
    d = torch.from_numpy(fill("random", 40, 2 * KiB, 4))
    pages = list(d) + list(code.encode(d))
    rng = np.random.default_rng(5)
    for _ in range(20):
        j, byte, bit = int(rng.integers(56)), int(rng.integers(2 * KiB)), int(rng.integers(8))
        bad = [p.clone() for p in pages]
        bad[j][byte] ^= 1 << bit
        rep = code.scrub(bad)
        assert not rep.consistent and rep.suspects == {j: 1}
    assert code.scrub(pages).consistent


def test_baked_header_is_current():
    assert baked.HEADER.read_text() == baked.render()


def test_cpu_kernels_take_any_dtype_and_separate_allocations(ext):
    code = ParityCode(4, 2, KiB, backend="cpu")
    d = fill("random", 4, KiB, 2)
    as_f32 = [torch.from_numpy(row.copy()).view(torch.float32) for row in d]
    assert torch.equal(code.encode(as_f32), ParityCode(4, 2, KiB, backend="reference").encode(torch.from_numpy(d)))
    assert gf16.generator(4, 2).shape == (2, 4)
