"""A model as users bring them (examples/byo_train.py, tests/unit/test_adopted.py): an output
head tied to the embedding, a frozen sub-module, a constant buffer computed in `__init__`, and
two parameter groups (no weight decay on biases and norms)."""
from __future__ import annotations

import torch

VOCAB, SEQ, BATCH = 32, 8, 4


class ByoNet(torch.nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        D = d
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.frozen = torch.nn.Linear(D, D)           # frozen by the script (a "pretrained" part)
        self.mix = torch.nn.Linear(D, D)
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))

    def forward(self, idx, tgt):
        h = self.emb(idx) * self.scale
        h = h + torch.tanh(self.frozen(h))
        logits = self.head(self.norm(torch.tanh(self.mix(h))))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def byo_init(model: ByoNet, seed: int) -> None:
    """Writes every parameter (frozen ones included) from `seed` alone."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def freeze(model: ByoNet) -> None:
    model.frozen.requires_grad_(False)


def groups(model: ByoNet, decay: float = 0.1, lr2: float | None = None) -> list[dict]:
    """Weights decayed; biases and norms not (and, if `lr2`, their own lr).  The frozen
    parameters stay in the groups, as `AdamW(model.parameters())` has them: torch skips them."""
    trainable = list(model.named_parameters())
    dec = [p for n, p in trainable if n.endswith("weight") and "norm" not in n]
    nodec = [p for n, p in trainable if not (n.endswith("weight") and "norm" not in n)]
    second = {"params": nodec, "weight_decay": 0.0}
    if lr2 is not None:
        second["lr"] = lr2
    return [{"params": dec, "weight_decay": decay}, second]


def tokens(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def make_optimizer(kind: str, params):
    """(torch optimizer, scheduler) of each tested kind; `foreach=False` (CUDA's default
    foreach spelling rounds differently, docs/PORTING.md)."""
    if kind == "adamw":
        opt = torch.optim.AdamW(params, lr=5e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    if kind == "adam":
        opt = torch.optim.Adam(params, lr=3e-3, betas=(0.8, 0.99), foreach=False)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, foreach=False)
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.5)
    raise ValueError(kind)
