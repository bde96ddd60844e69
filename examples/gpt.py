"""A small GPT-style language model for the Leto demo and the exactness tests.

Role: the workload that in-place resumption is checked against.  It is written so that Leto can
retain its state and a resumed run is bit-identical to a fault-free one:
  * No registered buffers, and no parameter appears twice (the LM head is NOT tied to the token
    embedding).  The model is built on the meta device and its parameters are then replaced by
    views of retained memory (`job.retain`); a buffer would be left uninitialized there, and a
    tied weight would be retained (and updated) twice.
  * `init_weights(model, seed)` writes values *in place* into whatever storage the parameters
    have (retained memory included), from a CPU `torch.Generator`, so CPU and GPU runs start from
    the same values.
  * `batch(seed, step, rank, ...)` is a pure function: a resumed trainer recomputes the same data.
  * dropout defaults to 0.0: dropout draws from the global RNG, which is not a function of the
    step; keep it at 0 for exactness runs.

Usage:
    cfg = GPTConfig.tiny()
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=dev)          # or: parameters become views of retained memory
    init_weights(model, seed=0)
    idx, targets = batch(seed=0, step=t, rank=r, batch_size=16, cfg=cfg, device=dev)
    logits, loss = model(idx, targets)

`examples/` is not a package: import it with `sys.path.insert(0, "<repo>/examples")`.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "init_weights", "batch", "corpus"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0

    def __post_init__(self):
        for f in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"GPTConfig.{f}={getattr(self, f)!r}: must be an int >= 1")
        if self.vocab_size < 2:
            raise ValueError(f"GPTConfig.vocab_size={self.vocab_size}: needs >= 2 tokens "
                             "(token 0 is the word separator of the synthetic corpus)")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd}: must be divisible by "
                             f"n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1)")

    @classmethod
    def tiny(cls) -> "GPTConfig":
        """CPU unit tests: 114,432 parameters."""
        return cls(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64)

    @classmethod
    def small(cls) -> "GPTConfig":
        """CPU demo: about 1.8M parameters."""
        return cls(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=192)

    @classmethod
    def gpu_1b(cls) -> "GPTConfig":
        """GPU demo (GPT-3 XL shape, untied head): about 1.42B parameters, i.e. about 22.7 GB of
        fp32 parameters + AdamW moments + gradients.  Not instantiated by the CPU tests; build it
        on the meta device and retain it on the GPU."""
        return cls(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)

    def num_params(self) -> int:
        """Parameter count of GPT(self), computed without building it."""
        d, V, T, L = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        per_block = (2 * d                  # ln_1
                     + 3 * d * d + 3 * d    # attn.qkv
                     + d * d + d            # attn.proj
                     + 2 * d                # ln_2
                     + 4 * d * d + 4 * d    # mlp.fc
                     + 4 * d * d + d)       # mlp.proj
        return V * d + T * d + L * per_block + 2 * d + d * V   # wte, wpe, blocks, ln_f, lm_head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # The softmax of low-precision attention scores loses the small probabilities; run
            # attention (and so its softmax) in fp32, then let autocast cast for the projection.
            with torch.autocast(device_type=dev, enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                   dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return F.dropout(self.proj(y), p, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, n_layer pre-LN blocks, final LayerNorm, untied LM head
    (no bias).  Parameters only, no buffers: positions are an `arange` built in forward and the
    causal mask is SDPA's `is_causal`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) int64 with T <= block_size.  Returns (logits (B, T, V), loss),
        loss the mean token cross-entropy computed in fp32 (None without targets)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = F.dropout(x, self.cfg.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic initialization, written in place into the existing parameter tensors (which
    may be views of external, retained memory: no parameter is replaced or re-allocated).

    Parameters are visited in `model.named_parameters()` order; one CPU `torch.Generator` seeded
    with `seed` draws normal(0, 0.02) for every Linear/Embedding weight, in that order, and the
    values are copied to the parameter's device, so CPU and GPU runs start identically.  Biases
    are zeros, LayerNorm weights ones and biases zeros (they draw nothing from the generator).
    """
    owner = {}
    for mod in model.modules():
        for pname, p in mod.named_parameters(recurse=False):
            owner[id(p)] = (mod, pname)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ValueError(f"init_weights: parameter {name!r} is on the meta device; give it "
                             "storage first (model.to_empty(device=...) or job.retain(model))")
        mod, pname = owner[id(p)]
        if isinstance(mod, nn.LayerNorm):
            p.fill_(1.0 if pname == "weight" else 0.0)
        elif isinstance(mod, (nn.Linear, nn.Embedding)):
            if pname == "weight":
                w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
                p.copy_(w)
            else:
                p.zero_()
        else:
            raise TypeError(f"init_weights: no rule for parameter {name!r} of {type(mod).__name__}")


def _seed_of(*parts: int) -> int:
    # A stable mix of the integers (Python's hash() is salted per process).
    h = hashlib.sha256(":".join(str(int(x)) for x in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


@functools.lru_cache(maxsize=4)
def corpus(seed: int, vocab_size: int, length: int = 1 << 17) -> torch.Tensor:
    """A fixed synthetic "text": `length` int64 tokens in [0, vocab_size), a pure function of its
    arguments.  64 random words (2..7 tokens from 1..vocab_size-1) are drawn with Zipf-like
    frequencies and separated by token 0, so the next token is predictable inside a word and
    only the choice of the next word is uncertain: the loss falls quickly from ln(vocab_size)."""
    g = torch.Generator().manual_seed(_seed_of(seed, vocab_size, 0xC0A))
    n_words = 64
    lens = torch.randint(2, 8, (n_words,), generator=g).tolist()
    words = [torch.cat([torch.randint(1, vocab_size, (n,), generator=g),
                        torch.zeros(1, dtype=torch.int64)]) for n in lens]
    weights = 1.0 / torch.arange(1, n_words + 1, dtype=torch.float64)
    mean_len = sum(lens) / n_words + 1
    picks = torch.multinomial(weights, int(length / mean_len * 1.5) + 1, replacement=True,
                              generator=g).tolist()
    out = torch.cat([words[i] for i in picks])[:length]
    if out.numel() < length:  # practically unreachable; keep the length contract anyway
        out = out.repeat(length // out.numel() + 1)[:length]
    return out


def batch(seed: int, step: int, rank: int, batch_size: int, cfg: GPTConfig,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), each (batch_size, cfg.block_size) int64 on `device`: windows of the
    `corpus(seed, cfg.vocab_size)` at offsets drawn by a generator seeded from (seed, step, rank);
    targets are the windows shifted by one token.  A pure function of its arguments."""
    data = corpus(seed, cfg.vocab_size)
    T = cfg.block_size
    if data.numel() < T + 2:
        raise ValueError(f"block_size={T} is too long for the {data.numel()}-token corpus")
    g = torch.Generator().manual_seed(_seed_of(seed, step, rank))
    starts = torch.randint(0, data.numel() - T - 1, (batch_size,), generator=g)
    windows = data[starts[:, None] + torch.arange(T + 1)]
    return windows[:, :-1].to(device), windows[:, 1:].to(device)
