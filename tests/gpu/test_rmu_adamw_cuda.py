"""leto_runtime.rmu.adamw on a CUDA device: chunked == whole bit for bit, and == torch.optim.AdamW
(foreach=False, fused=False) + clip_grad_norm_(foreach=False) on CUDA bit for bit.  Skipped without
CUDA (tests/gpu/conftest.py).  Run on the lent H200: `pytest tests/gpu -q`."""
from __future__ import annotations

import pytest
import torch

from leto_runtime.rmu.adamw import (AdamWConfig, adamw_chunk_, clip_coef, grad_sq_norm, lr_at,
                                    total_norm_from_sq)
from leto_testing import adamw_oracle

SIZES = (1, 7, 129, 4099, 1_000_003)   # odd sizes and offsets: vectorized and unrolled kernel paths


def _grads(gen, t, device):
    scale = 0.05 if t % 3 else 0.0005
    return [(torch.randn(n, generator=gen) * scale).to(device) for n in SIZES]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_cuda_bitwise_equal_to_torch_adamw(clip, wd):
    dev = torch.device("cuda")
    steps = 20
    cfg = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), weight_decay=wd, clip_grad_norm=clip,
                      warmup_steps=3, total_steps=steps, min_lr=3e-4)
    gen = torch.Generator().manual_seed(99)
    init = [torch.randn(n, generator=gen).to(dev) for n in SIZES]
    params, oracle, P, M, V = adamw_oracle(init, cfg)
    scratch = torch.empty(max(SIZES), device=dev)
    for t in range(steps):
        grads = _grads(gen, t, dev)
        lr = lr_at(cfg, t)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        oracle.param_groups[0]["lr"] = lr
        oracle.step()
        coef = None
        if clip is not None:
            norm = total_norm_from_sq(grad_sq_norm(grads))
            assert torch.equal(norm, ref_norm), (t, norm, ref_norm)
            coef = clip_coef(norm, clip)
        for i in range(len(SIZES)):
            adamw_chunk_(P[i], M[i], V[i], grads[i], step=t + 1, lr=lr, cfg=cfg, coef=coef,
                         scratch=scratch if i % 2 else None)
        for i, p in enumerate(params):
            assert torch.equal(P[i], p.detach()), (t, i, "param")
            assert torch.equal(M[i], oracle.state[p]["exp_avg"]), (t, i, "exp_avg")
            assert torch.equal(V[i], oracle.state[p]["exp_avg_sq"]), (t, i, "exp_avg_sq")


@pytest.mark.parametrize("clip", [False, True])
def test_cuda_chunked_equals_whole(clip):
    dev = torch.device("cuda")
    n = 3_000_017
    cfg = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(n, generator=gen).to(dev)
    grads = [torch.randn(n, generator=gen).to(dev) for _ in range(3)]
    coef = torch.tensor(0.37, device=dev) if clip else None
    # Random boundaries, including unaligned offsets and chunks shorter than a vector.
    cuts = sorted(set(torch.randint(1, n, (40,), generator=gen).tolist()) | {1, 2, 5, 1 << 20})
    bounds = [0, *cuts, n]
    g_copies = [g.clone() for g in grads]
    whole = [p0.clone(), torch.zeros(n, device=dev), torch.zeros(n, device=dev)]
    chunked = [p0.clone(), torch.zeros(n, device=dev), torch.zeros(n, device=dev)]
    scratch = torch.empty(n, device=dev)
    for t in range(3):
        adamw_chunk_(*whole, grads[t], step=t + 1, lr=lr_at(cfg, t), cfg=cfg, coef=coef)
        for a, b in zip(bounds, bounds[1:]):
            adamw_chunk_(chunked[0][a:b], chunked[1][a:b], chunked[2][a:b], grads[t][a:b],
                         step=t + 1, lr=lr_at(cfg, t), cfg=cfg, coef=coef, scratch=scratch)
    torch.cuda.synchronize()
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    for g, c in zip(grads, g_copies):
        assert torch.equal(g, c)   # gradients are read only
