"""The RMU's CUDA fast path on a GPU: the fused AdamW kernel (leto_runtime/rmu/fused.py) against
torch.optim.AdamW(foreach=False) itself, the syndrome delta path (parity/delta.py) against a full
re-encode, and a whole Updater with both against the torch-ops + pagewise path it replaces --
every comparison bit for bit.  Skipped without CUDA (tests/gpu/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from leto_runtime.parity import ParityCode
from leto_runtime.rmu import fused as F
from leto_runtime.rmu.adamw import (AdamWConfig, adamw_chunk_, clip_coef, grad_sq_norm, lr_at,
                                    total_norm_from_sq)
from leto_testing import adamw_oracle

MiB = 1 << 20
SIZES = (4, 7, 132, 4099, 1_000_003)


def test_some_variant_passes_the_self_check_and_is_picked():
    ext = F.load()
    cfg = AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0)
    dev = torch.device("cuda")
    res = {v: F.Fused(ext, cfg, v).self_check(dev) for v in range(16)}
    print("\nfused AdamW variants vs adamw_chunk_:", {v: (r or "identical") for v, r in res.items()})
    picked = F.Fused.for_device(dev, cfg)
    assert picked is not None, F.why_not
    assert res[picked.variant] == ""
    order = [0, 8, *[v for v in range(16) if v not in (0, 8)]]
    assert picked.variant == next(v for v in order if res[v] == "")


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fused_bitwise_equal_to_torch_adamw(clip, wd):
    dev = torch.device("cuda")
    steps = 20
    cfg = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), weight_decay=wd, clip_grad_norm=clip,
                      warmup_steps=3, total_steps=steps, min_lr=3e-4)
    f = F.Fused.for_device(dev, cfg)
    assert f is not None, F.why_not
    gen = torch.Generator().manual_seed(99)
    init = [torch.randn(n, generator=gen).to(dev) for n in SIZES]
    params, oracle, P, M, V = adamw_oracle(init, cfg)
    for t in range(steps):
        scale = 0.05 if t % 3 else 0.0005
        grads = [(torch.randn(n, generator=gen) * scale).to(dev) for n in SIZES]
        lr = lr_at(cfg, t)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        oracle.param_groups[0]["lr"] = lr
        oracle.step()
        coef = clip_coef(total_norm_from_sq(grad_sq_norm(grads)), clip) if clip is not None else None
        for i in range(len(SIZES)):
            old = [P[i].clone(), M[i].clone(), V[i].clone()]
            d = [torch.empty(SIZES[i], dtype=torch.int32, device=dev) for _ in range(3)]
            f.step_(P[i], M[i], V[i], grads[i], step=t + 1, lr=lr, coef=coef, deltas=d if i % 2 else None)
            if i % 2:
                for o, x, dd in zip(old, (P[i], M[i], V[i]), d):
                    assert torch.equal(dd, o.view(torch.int32) ^ x.view(torch.int32))
        for i, p in enumerate(params):
            assert torch.equal(P[i], p.detach()), (t, i, "param")
            assert torch.equal(M[i], oracle.state[p]["exp_avg"]), (t, i, "exp_avg")
            assert torch.equal(V[i], oracle.state[p]["exp_avg_sq"]), (t, i, "exp_avg_sq")


@pytest.mark.parametrize("k,m,first,count", [(1024, 16, 0, 64), (1024, 16, 960, 64), (1024, 16, 333, 128),
                                             (664, 16, 600, 64), (64, 4, 5, 7), (8, 16, 7, 1)])
def test_syndrome_delta_equals_reencode_on_cuda(k, m, first, count, monkeypatch):
    dev = torch.device("cuda")
    S = 64 * 1024
    code = ParityCode(k, m, S, backend="cuda")
    gen = torch.Generator(device=dev).manual_seed(k + first)
    data = torch.randint(0, 256, (k, S), dtype=torch.uint8, device=dev, generator=gen)
    q = code.encode(data)
    new = torch.randint(0, 256, (count, S), dtype=torch.uint8, device=dev, generator=gen)
    delta = data[first:first + count] ^ new
    data[first:first + count] = new
    want = code.encode(data)
    for method in ("syndrome", "pagewise"):
        out = torch.empty_like(q)
        code.update_delta(out, range(first, first + count), delta, base=q, method=method)
        assert code.last_delta_plan().method == method
        assert torch.equal(out, want), method
        inplace = q.clone()
        code.update(inplace, range(first, first + count), delta ^ new, new, method=method)
        assert torch.equal(inplace, want), method


def _run_updater(monkeypatch, fused: bool, delta_method: str, steps: int = 4, syndrome: bool = False):
    from leto_runtime.rmu.marker import Phase
    from leto_runtime.rmu.states import Geometry, Layout, open_states
    from leto_runtime.rmu.updater import Updater

    monkeypatch.setenv("LETO_RMU_FUSED", "1" if fused else "0")
    monkeypatch.setenv("LETO_PARITY_DELTA", delta_method)
    monkeypatch.setenv("LETO_RMU_FUSED_SYNDROME", "1" if syndrome else "0")
    dev = torch.device("cuda")
    geo = Geometry(3, 16, 1, 2 * MiB)        # 8 pages: groups of 3, 3, 2 (the load prefetch runs)
    layout = Layout.of([("a", (3_000_001,)), ("b", (777, 1311)), ("c", (5,))], geo.page_bytes)
    ss = open_states(layout, client=None, geo=geo, device=str(dev), chunk_pages=2)
    assert [gi.k for gi in ss.model[0].groups] == [3, 3, 2]
    up = Updater(ss, AdamWConfig(lr=1e-3, clip_grad_norm=1.0, weight_decay=0.1, total_steps=10),
                 backend="auto", lend=False)
    assert (up.fused is not None) == fused, F.why_not
    assert up.fused_syndrome == syndrome, F.why_not_syndrome
    gen = torch.Generator().manual_seed(3)
    P = ss.flat(ss.model[0])
    P[:layout.numel].copy_(torch.randn(layout.numel, generator=gen).to(dev))
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=-1, phase=Phase.DONE)
    G = ss.flat(ss.grads)
    for t in range(steps):
        up.begin(t)
        G[:layout.numel].copy_((torch.randn(layout.numel, generator=gen) * 0.01).to(dev))
        up.step(t)
    torch.cuda.synchronize()
    states = [ss.flat(s).clone() for s in ss.model]
    parity = [torch.cat([s.tier1(g).clone() for g in range(len(s.groups))]) for s in ss.model]
    assert up.side.prefetched is None        # every prefetched load was consumed
    codes = {gi.k: ParityCode(gi.k, 16, geo.page_bytes, backend="cuda") for gi in ss.model[0].groups}
    fresh = [torch.cat([codes[gi.k].encode(s.group_pages(g)).cpu() for g, gi in enumerate(s.groups)])
             for s in ss.model]
    up.close()
    return states, parity, fresh


def test_updater_fast_path_equals_torch_ops_path(monkeypatch):
    fast = _run_updater(monkeypatch, True, "syndrome")
    slow = _run_updater(monkeypatch, False, "pagewise")
    for a, b in zip(fast[0], slow[0]):
        assert torch.equal(a, b)
    for a, b in zip(fast[1], slow[1]):
        assert torch.equal(a.cpu(), b.cpu())
    for a, b in zip(fast[1], fast[2]):          # the retained parity is the encode of the state
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("k,first,count", [(1024, 0, 128), (1024, 896, 128), (1024, 333, 64), (664, 640, 24),
                                           (664, 128, 128), (16, 5, 5)])
def test_batched_scaled_delta_equals_reencode_on_cuda(k, first, count):
    """The RMU chunk delta: one launch for three page sets, the code's own encode matrix with
    the run's offset as a per-syndrome scale, parity = base ^ delta in the epilogue."""
    dev = torch.device("cuda")
    S = 64 * 1024
    code = ParityCode(k, 16, S, backend="cuda")
    gen = torch.Generator(device=dev).manual_seed(k * 7 + first)
    datas = [torch.randint(0, 256, (k, S), dtype=torch.uint8, device=dev, generator=gen) for _ in range(3)]
    bases = [code.encode(d) for d in datas]
    deltas = [torch.randint(0, 256, (count, S), dtype=torch.uint8, device=dev, generator=gen) for _ in range(3)]
    outs = [torch.empty_like(b) for b in bases]
    code.update_delta_many(outs, range(first, first + count), deltas, bases=bases, method="syndrome")
    for d, dl, o in zip(datas, deltas, outs):
        d[first:first + count] ^= dl
        assert torch.equal(o, code.encode(d))
    # in place (outs are the bases)
    code.update_delta_many(bases, range(first, first + count), deltas, bases=bases, method="syndrome")
    for b, o in zip(bases, outs):
        assert torch.equal(b, o)


@pytest.mark.parametrize("layout", list(F.LAYOUTS))
def test_adamw_syndrome_kernel_passes_its_self_check(layout, monkeypatch):
    """cuda/adamw_syndrome.cu (AdamW and the chunk's parity delta in one kernel, reading the undo
    copy) gives the bits of the fused AdamW kernel followed by the batched syndrome delta, in
    each of its layouts (tiling, grid order)."""
    monkeypatch.setenv("LETO_RMU_FUSED_SYNDROME", "1")
    monkeypatch.setenv(F.LAYOUT_ENV, layout)
    cfg = AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0)
    f = F.Fused.for_device(torch.device("cuda"), cfg)
    assert f is not None, F.why_not
    assert f.layout == F.LAYOUTS[layout]
    assert f.syndrome_check(torch.device("cuda")) == ""
    assert f.syndrome_ok("cuda"), F.why_not_syndrome


def test_updater_adamw_syndrome_kernel_equals_torch_ops_path(monkeypatch):
    """The whole Updater with the one-kernel chunk (3-3-2 groups: baked mix off, run-time mix on
    the short group) against the torch ops + pagewise parity path, states and parity."""
    one = _run_updater(monkeypatch, True, "syndrome", syndrome=True)
    slow = _run_updater(monkeypatch, False, "pagewise")
    for a, b in zip(one[0], slow[0]):
        assert torch.equal(a, b)
    for a, b in zip(one[1], slow[1]):
        assert torch.equal(a.cpu(), b.cpu())
    for a, b in zip(one[1], one[2]):
        assert torch.equal(a.cpu(), b)


def _full_size_chunk(dev, seed: int):
    """A 256-page chunk of 2 MiB pages at offset 768 of a baked (1024-page) group, as the updater
    runs it on a 1B-parameter model: (code, first, states, gradients, parity bases, coef)."""
    from leto_runtime.parity import ParityCode as PC
    S, n, first = 2 * MiB, 256, 768
    E = S // 4
    gen = torch.Generator(device=dev).manual_seed(seed)
    st = [torch.randn(n * E, device=dev, generator=gen), torch.randn(n * E, device=dev, generator=gen) * 1e-3,
          torch.rand(n * E, device=dev, generator=gen) * 1e-6]
    g = torch.randn(n * E, device=dev, generator=gen) * 1e-2
    q = [torch.randint(0, 256, (16, S), dtype=torch.uint8, device=dev, generator=gen) for _ in range(3)]
    return PC(1024, 16, S, backend="cuda"), first, st, g, q, torch.tensor(0.5, device=dev)


@pytest.mark.parametrize("layout", list(F.LAYOUTS))
def test_adamw_syndrome_kernel_on_full_size_groups(layout, monkeypatch):
    """2 MiB pages, a baked (1024-page) group: a 256-page chunk at offset 768, as the updater runs
    it on a 1B-parameter model, against the two-kernel path, in each layout."""
    monkeypatch.setenv("LETO_RMU_FUSED_SYNDROME", "1")
    monkeypatch.setenv(F.LAYOUT_ENV, layout)
    dev = torch.device("cuda")
    cfg = AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0)
    f = F.Fused.for_device(dev, cfg)
    code, first, st, g, q, coef = _full_size_chunk(dev, 5)
    S = code.page_bytes
    n = st[0].numel() * 4 // S
    ref = [t.clone() for t in st]
    d = [torch.empty_like(t, dtype=torch.int32) for t in st]
    f.step_(*ref, g, step=7, lr=cfg.lr, coef=coef, deltas=d)
    want = [torch.empty_like(x) for x in q]
    code.update_delta_many(want, range(first, first + n), [x.view(torch.uint8).view(n, S) for x in d], bases=q)
    got = [torch.empty_like(x) for x in q]
    undo = [t.clone() for t in st]
    f.chunk_syndrome_(st, undo, g, step=7, lr=cfg.lr, coef=coef, code=code, first=first, outs=got, bases=q)
    for a, b in zip(ref, st):
        assert torch.equal(a, b)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", list(F.BENCH_KERNELS))
def test_benchmark_chunk_kernels_pass_the_self_check(kernel):
    """The benchmarks' chunk kernels (fused.BENCH_KERNELS: the undo copy folded in with a
    cluster per tile, with stage counts, one CTA per tile with and without the fold) give the
    two-kernel path's states and parity bits; the folding ones write the values before the step
    to the undo buffer, bit for bit, and with stage counts every stage of every tile is counted."""
    if kernel.startswith("fold") and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fold kernels use thread-block clusters, which this GPU lacks (sm_90 and newer have them)")
    cfg = AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0)
    f = F.Fused.for_device(torch.device("cuda"), cfg)
    assert f is not None, F.why_not
    assert f.syndrome_check(torch.device("cuda"), kernel=kernel) == ""


def test_folded_chunk_passes_its_self_check_and_counts_a_full_size_chunk(monkeypatch):
    """cuda/adamw_ws.cu with the undo copy folded in (leto_runtime/rmu/fold.py): the one-kernel
    chunk's states and parity bits, the values before the step in the undo buffer, and every
    unit of both copies of the counts at all stages of this transaction -- on the self-check's
    cases and on a 256-page chunk of 2 MiB pages at offset 768 of a baked group."""
    from leto_runtime.rmu import fold as FD
    monkeypatch.setenv(F.LAYOUT_ENV, "ws")
    dev = torch.device("cuda")
    cfg = AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0)
    f = F.Fused.for_device(dev, cfg)
    assert f is not None and f.syndrome_ok(dev), F.why_not_syndrome
    assert f.fold_ok(dev), F.why_not_fold
    code, first, st, g, q, coef = _full_size_chunk(dev, 9)
    S = code.page_bytes
    n = st[0].numel() * 4 // S
    old = [t.clone() for t in st]
    ref = [t.clone() for t in st]
    want = [torch.empty_like(x) for x in q]
    f.chunk_syndrome_(ref, [t.clone() for t in old], g, step=7, lr=cfg.lr, coef=coef, code=code, first=first,
                      outs=want, bases=q)
    undo = [torch.full_like(t, float("nan")) for t in st]
    counts = [torch.full((FD.units(S),), -1, dtype=torch.int64, device=dev) for _ in range(2)]
    got = [torch.empty_like(x) for x in q]
    tg = FD.tag(41, 123, 200)
    f.chunk_fold_(st, undo, g, step=7, lr=cfg.lr, coef=coef, code=code, first=first, outs=got, bases=q,
                  counts=counts, tag=tg)
    for a, b in zip(ref, st):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(old, undo):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    for c in counts:
        assert bool((c == (tg << 16) | FD.n_stages(n)).all())
