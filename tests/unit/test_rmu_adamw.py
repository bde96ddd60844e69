"""leto_runtime.rmu.adamw on the CPU, against independent oracles: torch.optim.AdamW
(foreach=False, fused=False) + torch.nn.utils.clip_grad_norm_(foreach=False) bit for bit, the whole-
tensor update for chunked updates, and closed forms for the LR schedule."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leto_runtime.rmu.adamw import (AdamWConfig, adamw_chunk_, clip_coef, grad_sq_norm, lr_at,
                                    total_norm_from_sq)
from leto_testing import adamw_oracle

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
# Odd sizes: tails shorter than every vector width; 40_009 > 32768 so TensorIterator also splits
# the whole-tensor ops across threads.
SIZES = (1, 7, 129, 1000, 4099, 40_009)


def _grads(gen: torch.Generator, t: int) -> list[torch.Tensor]:
    # Alternate large and small gradients so that a 1.0 clip both triggers and does not.
    scale = 0.05 if t % 3 else 0.001
    return [torch.randn(n, generator=gen) * scale for n in SIZES]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("use_scratch", [False, True])
def test_bitwise_equal_to_torch_adamw(clip, wd, use_scratch):
    steps = 24
    cfg = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, clip_grad_norm=clip,
                      warmup_steps=4, total_steps=steps, min_lr=3e-4)
    gen = torch.Generator().manual_seed(1234)
    init = [torch.randn(n, generator=gen) for n in SIZES]

    params, oracle, P, M, V = adamw_oracle(init, cfg)
    scratch = torch.empty(max(SIZES)) if use_scratch else None
    clipped = unclipped = 0

    for t in range(steps):
        grads = _grads(gen, t)
        lr = lr_at(cfg, t)
        # oracle
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        oracle.param_groups[0]["lr"] = lr
        oracle.step()
        # ours
        coef = None
        if clip is not None:
            norm = total_norm_from_sq(grad_sq_norm(grads))
            assert torch.equal(norm, ref_norm), (t, norm, ref_norm)
            coef = clip_coef(norm, clip)
            clipped += bool(coef < 1)
            unclipped += bool(coef == 1)
        for i in range(len(SIZES)):
            adamw_chunk_(P[i], M[i], V[i], grads[i], step=t + 1, lr=lr, cfg=cfg, coef=coef,
                         scratch=scratch)
        for i, p in enumerate(params):
            st_ = oracle.state[p]
            assert torch.equal(P[i], p.detach()), (t, i, "param")
            assert torch.equal(M[i], st_["exp_avg"]), (t, i, "exp_avg")
            assert torch.equal(V[i], st_["exp_avg_sq"]), (t, i, "exp_avg_sq")
            assert torch.equal(grads[i] * (coef if coef is not None else 1.0), p.grad), (t, i, "grad")
    if clip is not None:
        assert clipped and unclipped, "the test must exercise both clipped and unclipped steps"


def test_clip_coef_matches_clip_grad_norm_scaling():
    # The coefficient clip_grad_norm_ multiplies with, recovered from what it did to a gradient
    # of ones-like values that are exact under any coefficient: g = 1 -> g * coef = coef.
    for scale in (1e-3, 0.3, 1.0, 7.0, 1e4):
        g = torch.full((3,), scale)
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = g.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=False)
        coef = clip_coef(total_norm_from_sq(grad_sq_norm([g])), 1.0)
        assert coef.dtype == torch.float32 and coef.dim() == 0
        assert torch.equal(g * coef, p.grad)
        expected = torch.clamp(1.0 / (ref_norm + 1e-6), max=1.0)
        assert torch.equal(coef, expected)


def _run(n_steps, p, m, v, grads, cfg, coef, cuts, scratch):
    bounds = [0, *cuts, p.numel()]
    for t in range(n_steps):
        for a, b in zip(bounds, bounds[1:]):
            adamw_chunk_(p[a:b], m[a:b], v[a:b], grads[t][a:b], step=t + 1, lr=lr_at(cfg, t),
                         cfg=cfg, coef=coef, scratch=scratch)


@SETTINGS
@given(n=st.integers(1, 3000), data=st.data(), clip=st.booleans(), wd=st.sampled_from([0.0, 0.1]),
       use_scratch=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_chunked_equals_whole(n, data, clip, wd, use_scratch, seed):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=12)))
    cuts = [c for c in cuts if 0 < c < n]
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=wd, warmup_steps=1, total_steps=4)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    coef = torch.tensor(0.37) if clip else None
    whole = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    chunked = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    _run(3, *whole, grads, cfg, coef, [], None)
    _run(3, *chunked, grads, cfg, coef, cuts, torch.empty(n + 5) if use_scratch else None)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_chunked_equals_whole_large_unaligned():
    # Chunks at odd offsets (unaligned data pointers) and of sizes around the thread split.
    n = 100_003
    cfg = AdamWConfig(lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    coef = torch.tensor(0.5)
    whole = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    chunked = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    _run(2, *whole, grads, cfg, coef, [], None)
    _run(2, *chunked, grads, cfg, coef, [1, 3, 17, 32_769, 32_770, 70_001, 99_999], torch.empty(40_000))
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_scratch", [False, True])
@pytest.mark.parametrize("with_coef", [False, True])
def test_g_is_read_only_and_redo_is_exact(use_scratch, with_coef):
    n = 517
    gen = torch.Generator().manual_seed(3)
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1)
    p, m, v, g = (torch.randn(n, generator=gen) for _ in range(4))
    v = v.abs()
    g_before = g.clone()
    coef = torch.tensor(0.25) if with_coef else None
    scratch = torch.empty(n) if use_scratch else None
    undo = [p.clone(), m.clone(), v.clone()]
    adamw_chunk_(p, m, v, g, step=5, lr=1e-2, cfg=cfg, coef=coef, scratch=scratch)
    assert torch.equal(g, g_before)
    first = [p.clone(), m.clone(), v.clone()]
    # Roll back from the undo copy and redo: the same bits (what the RMU does after a fault).
    for dst, src in zip((p, m, v), undo):
        dst.copy_(src)
    adamw_chunk_(p, m, v, g, step=5, lr=1e-2, cfg=cfg, coef=coef, scratch=scratch)
    for a, b in zip((p, m, v), first):
        assert torch.equal(a, b)


def test_chunk_argument_validation():
    cfg = AdamWConfig(lr=1e-3)
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="g must be a 1-D float32"):
        adamw_chunk_(x, x.clone(), x.clone(), torch.zeros(7), step=1, lr=1e-3, cfg=cfg, coef=None)
    with pytest.raises(ValueError, match="m must be a 1-D float32"):
        adamw_chunk_(x, x.double(), x.clone(), x.clone(), step=1, lr=1e-3, cfg=cfg, coef=None)
    with pytest.raises(ValueError, match="step=0"):
        adamw_chunk_(x, x.clone(), x.clone(), x.clone(), step=0, lr=1e-3, cfg=cfg, coef=None)
    with pytest.raises(ValueError, match="scratch"):
        adamw_chunk_(x, x.clone(), x.clone(), x.clone(), step=1, lr=1e-3, cfg=cfg, coef=None,
                     scratch=torch.zeros(4))


def test_norm_helpers():
    assert torch.equal(total_norm_from_sq(grad_sq_norm([])), torch.tensor(0.0))
    sq = grad_sq_norm([torch.tensor([3.0]), torch.tensor([4.0])])
    assert sq.dtype == torch.float64 and sq.item() == 25.0
    # Sharded use: per-shard squares summed, then the norm (right value, order-dependent bits).
    a, b = torch.randn(100), torch.randn(57)
    summed = total_norm_from_sq(grad_sq_norm([a]) + grad_sq_norm([b]))
    assert math.isclose(summed.item(), torch.cat([a, b]).norm().item(), rel_tol=1e-6)
    with pytest.raises(ValueError, match="grads\\[1\\]"):
        grad_sq_norm([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="float64"):
        total_norm_from_sq(torch.tensor(1.0))
    with pytest.raises(ValueError, match="float32"):
        clip_coef(torch.tensor(1.0, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_coef(torch.tensor(1.0), 0.0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(lr=0.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(lr=1e-3, betas=(0.9,)), "betas"),
    (dict(lr=1e-3, betas=(0.9, 1.0)), "betas"),
    (dict(lr=1e-3, eps=0.0), "eps"),
    (dict(lr=1e-3, weight_decay=-0.1), "weight_decay"),
    (dict(lr=1e-3, clip_grad_norm=0.0), "clip_grad_norm"),
    (dict(lr=1e-3, warmup_steps=-1), "warmup_steps"),
    (dict(lr=1e-3, warmup_steps=2.5), "warmup_steps"),
    (dict(lr=1e-3, total_steps=0), "total_steps"),
    (dict(lr=1e-3, warmup_steps=11, total_steps=10), "warmup_steps"),
    (dict(lr=1e-3, min_lr=2e-3), "min_lr"),
    (dict(lr=1e-3, min_lr=-1.0), "min_lr"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"AdamWConfig\.{field}="):
        AdamWConfig(**kwargs)


def test_config_frozen_and_paper_preset():
    cfg = AdamWConfig.paper(1000)
    assert (cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, cfg.clip_grad_norm) == \
        (2.2e-4, (0.9, 0.95), 1e-8, 0.1, 1.0)
    assert (cfg.warmup_steps, cfg.total_steps, cfg.min_lr) == (100, 1000, 2.2e-5)
    with pytest.raises(Exception):
        cfg.lr = 1.0  # frozen
    with pytest.raises(ValueError, match="total_steps"):
        AdamWConfig.paper(0)
    with pytest.raises(ValueError, match="step"):
        lr_at(cfg, -1)


def _closed_form(step, peak, floor, W, T):
    # Independent restatement: linear warmup to peak, then half a cosine period from peak at step
    # W down to floor at the last step T-1.
    if step < W:
        return peak * (step + 1) / W
    x = min(step - W, T - 1 - W) / (T - 1 - W)
    return floor + (peak - floor) * (1 + math.cos(math.pi * x)) / 2


def test_lr_schedule_paper_preset():
    T = 1001
    cfg = AdamWConfig.paper(T)
    W = cfg.warmup_steps
    assert W == 100
    peak, floor = 2.2e-4, 2.2e-5
    assert lr_at(cfg, 0) == pytest.approx(peak / 100, rel=1e-12)   # warmup start
    assert lr_at(cfg, W - 1) == peak                              # warmup end: exactly peak
    assert lr_at(cfg, W) == peak                                  # cosine start: exactly peak
    assert lr_at(cfg, W + 450) == pytest.approx((peak + floor) / 2, rel=1e-12)  # cosine midpoint
    assert lr_at(cfg, T - 1) == floor                             # last step: exactly the floor
    assert lr_at(cfg, T + 50) == floor                            # past the end: stays there
    for s in range(T):
        assert lr_at(cfg, s) == pytest.approx(_closed_form(s, peak, floor, W, T), rel=1e-12, abs=0)
    lrs = [lr_at(cfg, s) for s in range(T)]
    assert all(a < b for a, b in zip(lrs[:W], lrs[1:W]))          # strictly rising in warmup
    assert all(a >= b for a, b in zip(lrs[W:], lrs[W + 1:]))      # non-increasing after


def test_lr_schedule_without_decay_or_warmup():
    assert [lr_at(AdamWConfig(lr=0.5), s) for s in (0, 1, 10**6)] == [0.5, 0.5, 0.5]
    cfg = AdamWConfig(lr=0.5, warmup_steps=4)
    assert [lr_at(cfg, s) for s in range(6)] == [0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    cfg = AdamWConfig(lr=0.5, total_steps=3, min_lr=0.1)
    assert [lr_at(cfg, s) for s in range(3)] == pytest.approx([0.5, 0.3, 0.1], rel=1e-12)
