"""examples/gpt.py: meta-device build + in-place init equals a normal build bit for bit, no buffers
and no shared parameters, deterministic per-(seed, step, rank) data, the loss falls under AdamW,
and the presets have the advertised sizes (counted, and for gpu_1b computed without building)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig, batch, corpus, init_weights  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny model is dominated by per-op overhead; extra threads only contend on a busy box.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_meta_build_then_init_equals_cpu_build():
    cfg = GPTConfig.tiny()
    with torch.device("meta"):
        meta = GPT(cfg)
    assert all(p.is_meta for p in meta.parameters())
    with pytest.raises(ValueError, match="meta device"):
        init_weights(meta, seed=3)
    meta.to_empty(device="cpu")
    # Storage the init must write into, not replace (as with views of retained memory).
    ptrs = [p.data_ptr() for p in meta.parameters()]
    init_weights(meta, seed=3)
    assert ptrs == [p.data_ptr() for p in meta.parameters()]

    normal = GPT(cfg)
    init_weights(normal, seed=3)
    a, b = dict(meta.named_parameters()), dict(normal.named_parameters())
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name

    other = GPT(cfg)
    init_weights(other, seed=4)
    assert not torch.equal(other.wte.weight, normal.wte.weight)


def test_init_values_follow_the_rules():
    m = GPT(GPTConfig.tiny())
    init_weights(m, seed=0)
    for name, p in m.named_parameters():
        if ".ln_" in name or name.startswith("ln_f"):
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.std().item() - 0.02) < 0.02 * 0.25 and abs(p.mean().item()) < 0.005, name
    # Independent oracle: the first weight visited is wte.weight, the first draw of the generator.
    expect = torch.empty(m.wte.weight.shape).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    assert torch.equal(m.wte.weight, expect)


def test_no_buffers_and_no_tied_parameters():
    m = GPT(GPTConfig.tiny())
    assert list(m.buffers()) == []
    ptrs = [p.data_ptr() for p in m.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    assert m.lm_head.weight is not m.wte.weight
    # named_parameters(remove_duplicate=False) would list a tied weight twice
    assert len(list(m.named_parameters(remove_duplicate=False))) == len(list(m.parameters()))


def test_batch_is_a_pure_function_of_seed_step_rank():
    cfg = GPTConfig.tiny()
    x1, y1 = batch(0, 5, 1, 8, cfg, "cpu")
    corpus.cache_clear()                       # recomputing the corpus gives the same data
    x2, y2 = batch(0, 5, 1, 8, cfg, "cpu")
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (8, cfg.block_size) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    assert int(x1.min()) >= 0 and int(x1.max()) < cfg.vocab_size
    for other in [(0, 6, 1), (0, 5, 0), (1, 5, 1)]:
        assert not torch.equal(batch(*other, 8, cfg, "cpu")[0], x1), other


def test_adamw_steps_reduce_the_loss():
    cfg = GPTConfig.tiny()
    m = GPT(cfg)
    init_weights(m, seed=0)
    held_out = batch(0, 10**9, 0, 32, cfg)

    def eval_loss():
        with torch.no_grad():
            return m(*held_out)[1].item()

    before = eval_loss()
    assert abs(before - math.log(cfg.vocab_size)) < 0.1  # near-uniform at init
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(25):
        _, loss = m(*batch(0, step, 0, 16, cfg))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = eval_loss()
    assert after < before - 1.0, (before, after)


def test_forward_shapes_and_autocast_path():
    cfg = GPTConfig.tiny()
    m = GPT(cfg)
    init_weights(m, seed=0)
    idx, tgt = batch(0, 0, 0, 2, cfg)
    logits, loss = m(idx)
    assert logits.shape == (2, cfg.block_size, cfg.vocab_size) and loss is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits_bf, loss_bf = m(idx, tgt)
    assert loss_bf.dtype == torch.float32 and math.isfinite(loss_bf.item())
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, cfg.block_size + 1, dtype=torch.int64))


def test_preset_sizes():
    tiny, small, big = GPTConfig.tiny(), GPTConfig.small(), GPTConfig.gpu_1b()
    for cfg in (tiny, small):
        assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params()
    assert 100_000 <= tiny.num_params() <= 300_000
    assert 1_000_000 <= small.num_params() <= 2_000_000
    with torch.device("meta"):   # meta only: no memory for 1.4B parameters
        assert sum(p.numel() for p in GPT(big).parameters()) == big.num_params()
    assert big.num_params() >= 1_000_000_000


def test_config_validation():
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig(vocab_size=96, block_size=8, n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(vocab_size=96, block_size=8, n_layer=1, n_head=2, n_embd=64, dropout=1.0)
