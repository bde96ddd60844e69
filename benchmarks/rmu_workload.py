"""The training workload of benchmarks/rmu_overhead.py (scrub_overhead.py uses it through that
module): the GPT of examples/gpt.py (bound to flat buffers by `Layout.bind`),
its batches, the compute phase of an iteration, and the AdamW settings of every variant.

Calling contract: `a` is rmu_overhead's parsed arguments (model, seq, batch_size, accum, warmup,
iters); build_model needs examples/ on sys.path (rmu_overhead puts it there).  Deterministic:
the same seeds in every variant, so the compute phase is the same program in each.
"""
from __future__ import annotations

import torch


def build_model(a, dev):
    from gpt import GPT, GPTConfig
    import dataclasses
    cfg = getattr(GPTConfig, a.model)()
    if a.seq and a.seq != cfg.block_size:
        cfg = dataclasses.replace(cfg, block_size=a.seq)
    with torch.device("meta"):
        model = GPT(cfg)
    return cfg, model


def init_params(P: torch.Tensor, n: int) -> None:
    g = torch.Generator(device=P.device).manual_seed(0)
    P[:n].normal_(0.0, 0.02, generator=g)


def make_batch(cfg, a, dev, t):
    g = torch.Generator(device="cpu").manual_seed(1000 + t)
    idx = torch.randint(0, cfg.vocab_size, (a.batch_size, cfg.block_size + 1), generator=g)
    return idx[:, :-1].to(dev, non_blocking=True), idx[:, 1:].to(dev, non_blocking=True)


def forward_backward(model, cfg, a, dev, t):
    """The compute phase of iteration t: a.accum micro-batches, gradients accumulated."""
    for k in range(a.accum):
        idx, tgt = make_batch(cfg, a, dev, t * a.accum + k)
        ac = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else \
            torch.autocast("cpu", enabled=False)
        with ac:
            logits, loss = model(idx, tgt)
        del logits                    # nothing but the scalar loss outlives the compute phase
        loss.backward()
    return loss


def adamw_cfg(a):
    from leto_runtime.rmu.adamw import AdamWConfig
    return AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0,
                       warmup_steps=2, total_steps=a.warmup + a.iters + 10)
