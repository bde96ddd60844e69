"""`job.meta_init()` / `job.retain()` on models as users write them (plain mode, no agent):
tied weights, constant buffers, buffers left on the meta device, buffers forward mutates,
frozen parameters, the sign of a first gradient.  The oracle is the same model built and
trained by stock torch (`torch.optim.AdamW(foreach=False)` + `clip_grad_norm_`)."""
from __future__ import annotations


import pytest
import torch

from leto_runtime import runtime
from leto_testing import plain_job
from leto_runtime.rmu.adamw import AdamWConfig, lr_at


@pytest.fixture(name="plain_job")
def _plain_job(monkeypatch):
    yield plain_job(monkeypatch)
    runtime.current().forget_job()


class TiedWithBuffer(torch.nn.Module):
    """An LLM's two common shapes in miniature: the output head tied to the embedding, and a
    constant buffer computed in `__init__`."""

    def __init__(self, vocab: int = 32, d: int = 16, meta_buffer: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.mix = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        scale = torch.empty(d, device="meta") if meta_buffer else torch.linspace(0.5, 1.5, d)
        self.register_buffer("scale", scale)

    def forward(self, idx, tgt):
        logits = self.head(torch.tanh(self.mix(self.emb(idx) * self.scale)))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def _tied_init(model, seed):
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.emb.weight, 0.0, 0.2)
    model.mix.reset_parameters()


def _tokens(step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 32, (4, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _train_leto(job, model, opt, steps):
    losses = []
    for step in job.steps(steps):
        _, loss = model(*_tokens(step))
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses


def _train_torch(ac, steps):
    ref = TiedWithBuffer()
    _tied_init(ref, 3)
    o = torch.optim.AdamW(ref.parameters(), lr=ac.lr, betas=ac.betas, weight_decay=ac.weight_decay,
                          foreach=False)
    losses = []
    for step in range(steps):
        _, loss = ref(*_tokens(step))
        losses.append(loss.item())
        o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), ac.clip_grad_norm, foreach=False)
        for g in o.param_groups:
            g["lr"] = lr_at(ac, step)
        o.step()
    return ref, losses


AC = AdamWConfig(lr=5e-3, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0,
                 warmup_steps=2, total_steps=8)


@pytest.mark.parametrize("meta_buffer", [False, True], ids=["init-buffer", "buffers-fn"])
def test_tied_weights_and_a_constant_buffer_match_torch_adamw_bitwise(plain_job, meta_buffer):
    job = plain_job
    with job.meta_init():
        model = TiedWithBuffer(meta_buffer=meta_buffer)
    assert model.emb.weight.is_meta and model.mix.bias.requires_grad
    assert model.scale.is_meta == meta_buffer       # a buffer __init__ computes keeps its values
    fill = (lambda m: m.scale.copy_(torch.linspace(0.5, 1.5, 16))) if meta_buffer else None
    held = list(model.parameters())
    model = job.retain(model, init=_tied_init, buffers=fill)
    opt = job.adamw(model, AC)
    # One retained slot for the tied weight, both modules hold that one parameter, and the
    # Parameter objects are the script's own (a torch optimizer built on them stays valid).
    assert model.head.weight is model.emb.weight and len(job.layout.params) == 3
    assert all(a is b for a, b in zip(model.parameters(), held))
    losses = _train_leto(job, model, opt, 8)
    ref, ref_losses = _train_torch(AC, 8)
    assert losses == ref_losses and len(set(losses)) == 8     # it trains, as torch does
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    assert torch.equal(model.scale, ref.scale)
    # What the model trained is the retained state (`to_empty` once detached them).
    P = job.state_tensors()["leto/params"]
    for slot, (n, p) in zip(job.layout.params, model.named_parameters()):
        assert torch.equal(P[slot.offset:slot.offset + slot.numel].view(slot.shape), p), n


def test_a_meta_buffer_without_a_fill_function_is_refused(plain_job):
    with plain_job.meta_init():
        model = TiedWithBuffer(meta_buffer=True)
    with pytest.raises(ValueError, match=r"buffers scale are on the meta device: pass "
                                         r"retain\(model, buffers=fn\)"):
        plain_job.retain(model)


def test_batch_norm_running_stats_are_refused(plain_job):
    with plain_job.meta_init():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"^1: batch-norm running statistics .*"
                                         r"track_running_stats=False"):
        plain_job.retain(model)


class Counter(torch.nn.Module):
    """A buffer forward changes, unknown to any refusal list."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        return self.lin(x)


def test_a_buffer_forward_changes_stops_the_step_with_its_name(plain_job):
    with plain_job.meta_init():
        model = Counter()
    model = plain_job.retain(model)
    opt = plain_job.adamw(model, lr=1e-2)
    with pytest.raises(ValueError, match=r"buffer 'seen' changed during step 0: buffers are not "
                                         r"retained"):
        for _ in plain_job.steps(2):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()


def test_frozen_parameters_are_refused_with_the_fix(plain_job):
    with plain_job.meta_init():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model = plain_job.retain(model)
    with pytest.raises(ValueError, match=r"frozen parameters .*0\.weight, 0\.bias.*outside"):
        plain_job.adamw(model, lr=1e-2)
    model[0].requires_grad_(True)
    opt = plain_job.adamw(model, lr=1e-2, weight_decay=0.5)
    model[1].requires_grad_(False)          # frozen after retain(): refused at the step
    with pytest.raises(ValueError, match="frozen parameters"):
        for _ in plain_job.steps(2):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()


class SignedZero(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self):
        return (self.w * torch.tensor([-0.0, 1.0, 0.0])).sum()


def test_a_first_gradient_keeps_the_sign_of_zero_as_in_torch(plain_job):
    """Stock torch's first backward creates `.grad` with the gradient's bits; accumulating
    into a +0.0-filled view would turn a -0.0 into +0.0 (which SGD's first momentum copy,
    for one, keeps)."""
    ref = SignedZero()
    ref().backward()
    with plain_job.meta_init():
        model = SignedZero()
    model = plain_job.retain(model, init=lambda m, seed: m.w.fill_(1.0))
    opt = plain_job.adamw(model, lr=1e-2)
    for _ in plain_job.steps(1):
        model().backward()
        assert torch.equal(torch.signbit(model.w.grad), torch.signbit(ref.w.grad))
        assert torch.signbit(ref.w.grad).tolist() == [True, False, False]
        opt.step()


def test_adamw_takes_a_config_or_keywords_only(plain_job):
    with plain_job.meta_init():
        model = torch.nn.Linear(4, 2)
    model = plain_job.retain(model)
    with pytest.raises(TypeError, match=r"config must be a leto_runtime\.rmu\.adamw\.AdamWConfig, "
                                        r"got list \(parameter groups are not supported"):
        plain_job.adamw(model, [{"params": list(model.parameters())}])


def test_parameters_that_are_not_float32_are_refused(plain_job):
    with plain_job.meta_init():
        model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"parameters weight \(torch.bfloat16\), bias "
                                         r"\(torch.bfloat16\) are not float32.*job.autocast\(\)"):
        plain_job.retain(model)
