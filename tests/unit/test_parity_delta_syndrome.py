"""Delta update of a contiguous run through the syndrome kernel (leto_runtime/parity/delta.py):
bit-identical to a full re-encode of the new data, on the NumPy reference and the C++ kernels
(every vector ISA), for random geometries, runs at the start / middle / end of the group, both
tiers of a ProtectionGroup, and the base= / scratch= / update_delta variants RMU can use."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leto_runtime.parity import ParityCode, ProtectionGroup, _ext, backends, delta, gf16

KiB = 1 << 10


def _cpu_available() -> bool:
    if _ext._compiler() is None:
        return False
    try:
        import torch.utils.cpp_extension as cpp
        cpp.verify_ninja_availability()
    except RuntimeError:
        return False
    return True


BACKENDS = ["reference", pytest.param("cpu", marks=pytest.mark.skipif(not _cpu_available(),
                                                                   reason="no C++ toolchain"))]


def rand(rng, n: int, S: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, (n, S), dtype=np.uint8))


def geometries(seed: int, n: int):
    """Random (k, m, S, first, count): k <= 64 pages of 4..64 KiB, m 1..16, the run at the start,
    in the middle or at the end of the group, count 1..k."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(1, 65))
        m = int(rng.integers(1, 17))
        S = int(rng.choice([4, 8, 16, 32, 64])) * KiB
        count = int(rng.integers(1, k + 1))
        where = ("start", "middle", "end")[i % 3]
        first = 0 if where == "start" else k - count if where == "end" else int(rng.integers(0, k - count + 1))
        out.append((k, m, S, first, count))
    return out


# Keep the reference cases smaller (its encode runs at ~0.05-0.1 GB/s).
CASES = {"reference": geometries(1, 9), "cpu": geometries(2, 14)}
CASES["reference"] = [(k, m, min(S, 16 * KiB), f, c) for k, m, S, f, c in CASES["reference"]]
CASES["reference"] += [(64, 16, 4 * KiB, 0, 64), (33, 5, 4 * KiB, 32, 1), (1, 1, 4 * KiB, 0, 1)]
CASES["cpu"] += [(64, 16, 64 * KiB, 0, 64), (64, 16, 4 * KiB, 63, 1), (64, 1, 32 * KiB, 10, 40),
                 (2, 16, 4 * KiB, 1, 1)]


PARAMS = [pytest.param(b if isinstance(b, str) else b.values[0], i, marks=() if isinstance(b, str) else b.marks,
                       id=f"{b if isinstance(b, str) else b.values[0]}-{i}")
          for b in BACKENDS for i in range(len(CASES[b if isinstance(b, str) else b.values[0]]))]


@pytest.mark.parametrize("backend,case", PARAMS)
def test_syndrome_delta_equals_reencode(backend, case):
    k, m, S, first, count = CASES[backend][case]
    rng = np.random.default_rng(case * 31 + k)
    code = ParityCode(k, m, S, backend=backend)
    d = rand(rng, k, S)
    p = code.encode(d)
    new = rand(rng, count, S)
    d2 = d.clone()
    d2[first:first + count] = new
    want = code.encode(d2)
    idx = list(range(first, first + count))
    for method in ("syndrome", "pagewise", "auto"):
        got = p.clone()
        code.update(got, idx, d[first:first + count].clone(), new, method=method)
        if method != "auto":
            assert code.last_delta_plan().method == method
        assert torch.equal(got, want), (k, m, S, first, count, method)
    # update_delta, base= and a lent scratch (exactly count + m pages, as RMU would lend)
    got = p.clone()
    code.update_delta(got, range(first, first + count), d[first:first + count] ^ new, method="syndrome")
    assert torch.equal(got, want)
    out = torch.full_like(p, 0xA5)
    scratch = torch.empty((count + m) * S // 4, dtype=torch.float32)
    code.update(out, idx, d[first:first + count].clone(), new, base=p, scratch=scratch, method="syndrome")
    assert torch.equal(out, want) and torch.equal(p, code.encode(d))      # base untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_isa_and_page_lists(backend):
    """Pages as separate allocations of a non-uint8 dtype; on C++ every vector ISA."""
    k, m, S = 40, 16, 8 * KiB
    rng = np.random.default_rng(7)
    d = rand(rng, k, S)
    new = rand(rng, 24, S)
    d2 = d.clone()
    d2[10:34] = new
    isas = [None]
    if backend == "cpu":
        ext = _ext.load_cpu()
        best = ext.set_isa("auto")
        order = ["avx512", "avx2", "base"]
        isas = order[order.index(best):]
    try:
        for isa in isas:
            if isa:
                _ext.load_cpu().set_isa(isa)
            code = ParityCode(k, m, S, backend=backend)
            want = code.encode(d2)
            par = [row.clone().view(torch.float32) for row in code.encode(d)]
            olds = [row.clone().view(torch.int32) for row in d[10:34]]
            news = [row.clone().view(torch.int16) for row in new]
            code.update(par, range(10, 34), olds, news, method="syndrome")
            assert torch.equal(torch.stack([p.view(torch.uint8) for p in par]), want), isa
    finally:
        if backend == "cpu":
            _ext.load_cpu().set_isa("auto")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H1,H2", [(16, 1), (9, 2), (4, 1)])
@pytest.mark.parametrize("split", [False, True])
def test_group_update_both_tiers(backend, H1, H2, split, monkeypatch):
    """Two tiers in one syndrome pass; `split`: the backend takes at most H1 outputs per call
    (as CUDA's 16 with H1 + H2 = 17), so tier 2 comes from a tier-2 encode of tier 1's delta."""
    D, S = 48, 4 * KiB
    grp = ProtectionGroup(D, H1, H2, S, backend=backend)
    be = grp.tier1.backend_for(torch.device("cpu"))
    if split:
        monkeypatch.setattr(type(be), "max_outputs", H1)
    rng = np.random.default_rng(H1 * 10 + H2)
    d = rand(rng, D, S)
    p1, p2 = grp.encode(d)
    for first, count in ((0, 20), (15, 33), (47, 1)):
        new = rand(rng, count, S)
        grp.update(p1, p2, list(range(first, first + count)), d[first:first + count].clone(), new,
                   method="syndrome")
        d[first:first + count] = new
        w1, w2 = grp.encode(d)
        assert torch.equal(p1, w1) and torch.equal(p2, w2), (first, count)


def test_base_that_is_the_parity_means_in_place():
    code = ParityCode(10, 4, KiB, backend="reference")
    rng = np.random.default_rng(3)
    d = rand(rng, 10, KiB)
    p = code.encode(d)
    new = rand(rng, 6, KiB)
    code.update(p, range(2, 8), d[2:8].clone(), new, base=p, method="syndrome")
    d[2:8] = new
    assert torch.equal(p, code.encode(d))


def test_small_scratch_is_supplemented():
    """A scratch that holds old ^ new but not the temp: the temp is allocated."""
    code = ParityCode(20, 8, 2 * KiB, backend="reference")
    rng = np.random.default_rng(4)
    d = rand(rng, 20, 2 * KiB)
    p = code.encode(d)
    new = rand(rng, 12, 2 * KiB)
    code.update(p, range(4, 16), d[4:16].clone(), new, scratch=torch.empty(12 * 2 * KiB, dtype=torch.uint8),
                method="syndrome")
    d[4:16] = new
    assert torch.equal(p, code.encode(d))


# ---- the chooser (pure) ---------------------------------------------------------------------
def test_choose_needs_a_contiguous_ascending_run():
    for idx in ([3, 5, 6], [6, 5, 4], [2, 2, 3], []):
        plan = delta.choose("cpu", 16, 16, idx, method="auto")
        assert plan.method == "pagewise"
    assert delta.choose("cpu", 16, 16, [1, 3], method="syndrome").method == "pagewise"  # forced, not a run
    assert delta.run_start(range(7, 40)) == 7 and delta.run_start([4]) == 4


@pytest.fixture
def cuda_auto(monkeypatch):
    monkeypatch.setattr(delta, "CUDA_AUTO", True)


def test_cuda_auto_is_on_and_switching_it_off_keeps_the_pagewise_kernel(monkeypatch):
    assert delta.CUDA_AUTO      # validated on the H200 (tests/gpu/test_rmu_fused_gpu.py)
    assert delta.choose("cuda", 16, 16, list(range(0, 256))).method == "syndrome"
    monkeypatch.setattr(delta, "CUDA_AUTO", False)
    plan = delta.choose("cuda", 16, 16, list(range(64, 96)))
    assert plan.method == "pagewise" and "switched off" in plan.reason
    assert delta.choose("cuda", 16, 16, list(range(64, 96)), method="syndrome").method == "syndrome"


@pytest.mark.parametrize("backend", ["cpu", "cuda", "reference"])
def test_choose_crossover(backend, cuda_auto):
    """Short runs stay pagewise (the rows x m mix is a fixed cost), long runs go to the encode
    kernel; RMU's 32-page chunk at m = 16 takes the syndrome path on every backend (CUDA: once
    enabled, `delta.CUDA_AUTO`)."""
    assert delta.choose(backend, 16, 16, [100]).method == "pagewise"
    assert delta.choose(backend, 16, 16, list(range(4))).method == "pagewise"
    plan = delta.choose(backend, 16, 16, list(range(64, 96)))
    assert plan.method == "syndrome" and plan.first == 64 and "syndrome" in plan.reason
    assert plan.cost_syndrome < plan.cost_pagewise
    assert delta.choose(backend, 16, 16, list(range(1024))).method == "syndrome"
    with pytest.raises(ValueError):
        delta.choose(backend, 16, 16, [1], method="fast")


def test_shifted_matrix_is_the_generator_run():
    """M diag(x^(first t)) times the run's Vandermonde block equals G's columns of the run."""
    k, m, first, count = 50, 7, 13, 9
    Mp = delta.shifted_encode_matrix(k, m, first)
    V = gf16.EXP[np.mod(np.outer(gf16.exponents(m), np.arange(count)), gf16.ORDER)].astype(np.uint16)
    assert np.array_equal(gf16.mat_mul(Mp, V), gf16.generator(k, m)[:, first:first + count])


def test_update_uses_the_syndrome_path_for_rmu_chunks():
    if not _cpu_available():
        pytest.skip("no C++ toolchain")
    code = ParityCode(128, 16, KiB, backend="cpu")
    rng = np.random.default_rng(5)
    d = rand(rng, 128, KiB)
    p = code.encode(d)
    new = rand(rng, 32, KiB)
    code.update(p, list(range(32, 64)), d[32:64].clone(), new)
    assert code.last_delta_plan().method == "syndrome"
    d[32:64] = new
    assert torch.equal(p, code.encode(d))
    assert isinstance(backends.cpu_backend(), backends.CpuBackend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_delta_many_equals_reencode_of_each_set(backend):
    """RMU's batched chunk delta (params, exp_avg, exp_avg_sq): each parity = base ^ delta of
    its own set, equal to a full re-encode (CPU/reference: one update_delta per set)."""
    k, m, S, first, count = 24, 6, 4 * KiB, 9, 7
    code = ParityCode(k, m, S, backend=backend)
    rng = np.random.default_rng(11)
    datas = [rand(rng, k, S) for _ in range(3)]
    bases = [code.encode(d) for d in datas]
    deltas = [rand(rng, count, S) for _ in range(3)]
    outs = [torch.empty_like(b) for b in bases]
    code.update_delta_many(outs, range(first, first + count), deltas, bases=bases)
    for d, dl, o in zip(datas, deltas, outs):
        d[first:first + count] ^= dl
        assert torch.equal(o, code.encode(d))
    with pytest.raises(Exception, match="one of each"):
        code.update_delta_many(outs[:2], range(first, first + count), deltas, bases=bases)


def test_run_scale_is_the_shift_of_the_shifted_matrix():
    k, m, first = 40, 9, 13
    M = gf16.encode_matrix(k, m)
    assert np.array_equal(gf16.mul(M, delta.run_scale(m, first)[None, :]), delta.shifted_encode_matrix(k, m, first))


@pytest.mark.parametrize("m,first", [(16, 333), (4, 7), (1, 5)])
def test_scale_window_places_each_exponent_in_the_kernel_window(m, first):
    """The CUDA launch's scale operand (CudaBackend.scale_window, also the AdamW + parity kernel's):
    x^(first t) at kernel column t - T_LO_MIN for each exponent of the code, 0 elsewhere."""
    from leto_runtime.parity.backends import CudaBackend
    ts = gf16.exponents(m)
    w = CudaBackend.scale_window(ts, delta.run_scale(m, first)).numpy()
    assert w.shape == (len(gf16.KERNEL_T),)
    for col, t in enumerate(gf16.KERNEL_T):
        want = int(gf16.EXP[(first * t) % gf16.ORDER]) if t in ts else 0
        assert w[col] == want, (t, w[col], want)
