"""A waiting shadow's warm-up forward (leto_runtime/warmup.py): it runs the script's forward
once, and leaves nothing behind that a promoted trainer would see -- the oracle is the same
module's state and the random streams captured before the call (a norm's running statistics
and its call counter, which a training-mode forward updates; dropout's draw of the RNG)."""
from __future__ import annotations

import types

import pytest
import torch

from leto_runtime import warmup


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(self.lin(x)))


def _job(fn, model):
    return types.SimpleNamespace(warmup_fn=fn, bound=False, model=model,
                                 device=torch.device("cpu"), _warming=False)


def test_the_forward_runs_once_and_leaves_buffers_and_random_streams_as_they_were():
    model = Net().train()
    calls = []

    def fn():
        calls.append(torch.is_grad_enabled())
        return model(torch.randn(4, 8))

    job = _job(fn, model)
    before = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    assert warmup.run(job) is not None
    assert calls == [False, True]                        # under no_grad, then the backward's
    assert job.warmup_backward == warmup.BACKWARD_FULL
    assert all(p.grad is None for p in model.parameters())   # returned, never accumulated
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert torch.equal(rng, torch.get_rng_state())
    # without the restore the forward would have changed both (the oracle is not vacuous)
    model(torch.randn(4, 8))
    assert not all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert warmup.run(job) is None and len(calls) == 2   # once per process


def test_nothing_runs_without_a_function_or_once_the_parameters_are_bound():
    model = Net()
    assert warmup.run(_job(None, model)) is None
    job = _job(lambda: pytest.fail("ran after binding"), model)
    job.bound = True
    assert warmup.run(job) is None


def test_a_failing_warm_up_is_logged_and_changes_nothing(capsys):
    model = Net().train()
    before = {n: b.clone() for n, b in model.named_buffers()}

    def fn():
        model(torch.randn(4, 8))                          # updates the statistics, then fails
        raise RuntimeError("CUDA out of memory (a stand-in message)")

    assert warmup.run(_job(fn, model)) is None
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert "warm-up forward failed" in capsys.readouterr().err


def test_job_warmup_refuses_what_it_cannot_call():
    from leto_runtime.errors import PortingError
    from leto_runtime.job import Job
    with pytest.raises(PortingError, match="callable"):
        Job.warmup(types.SimpleNamespace(), 3)


def test_the_backward_runs_every_weight_product_once_within_the_cap():
    """One parameter per (shape, dtype) gets a gradient, none bigger than cap / 8, all together
    at most cap / 4; frozen ones never (the oracle: the parameters' own shapes and sizes)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
                            torch.nn.Linear(16, 64), torch.nn.Linear(64, 4))
    m[3].weight.requires_grad_(False)
    cap = 16 * 64 * 4 * 8                     # a 16x64 fp32 weight is exactly cap / 8
    got = warmup.one_per_shape(m, cap)
    assert [tuple(p.shape) for p in got] == [(16, 16), (16,), (64, 16), (64,), (4,)]
    assert sum(p.numel() * 4 for p in got) <= cap // 4
    assert warmup.one_per_shape(m, 64) == []  # nothing fits: no backward beyond the engine's


def test_the_backward_starts_from_the_loss_the_forward_returned():
    x = torch.ones(3, requires_grad=True)
    logits, loss = x * 2, (x * 3).sum()
    assert warmup.scalar_of((logits, loss)) is not None
    assert torch.equal(warmup.scalar_of((logits, loss)), loss)
    assert torch.equal(warmup.scalar_of({"out": logits}), logits.sum())
    assert warmup.scalar_of(torch.ones(2)) is None          # nothing needs a gradient
    assert warmup.scalar_of(None) is None


def test_a_backward_that_does_not_fit_leaves_the_forward_warm(capsys):
    model = Net().train()
    n = []

    def fn():
        n.append(torch.is_grad_enabled())
        if torch.is_grad_enabled():
            raise RuntimeError("CUDA out of memory (a stand-in message)")
        return model(torch.randn(4, 8))

    job = _job(fn, model)
    assert warmup.run(job) is not None                 # the forward's warm-up counts
    assert n == [False, True] and job.warmup_backward == warmup.BACKWARD_ENGINE
    assert "backward of the script's forward did not run" in capsys.readouterr().err


def test_the_cap_is_the_setting_else_the_agent_s_room_else_the_default(monkeypatch):
    """`cap_of`: LETO_WARMUP_MIB wins; unset (or auto), the room the agent put in the shadow's
    contract (LETO_WARMUP_ROOM, read through Context); without either, DEFAULT_MIB."""
    from leto_runtime import Context
    from leto_runtime.wire import contract as C
    under = {C.LETO_CONTRACT_VERSION: str(C.CONTRACT_VERSION), C.LETO_ROLE: "shadow"}
    job = types.SimpleNamespace(ctx=Context.from_env({**under, C.LETO_WARMUP_ROOM: str(6 << 30)}))
    monkeypatch.delenv("LETO_WARMUP_MIB", raising=False)
    assert warmup.cap_of(job) == (6 << 30, "the agent's view of the device")
    monkeypatch.setenv("LETO_WARMUP_MIB", "auto")
    assert warmup.cap_of(job)[0] == 6 << 30
    monkeypatch.setenv("LETO_WARMUP_MIB", "300")
    assert warmup.cap_of(job) == (300 << 20, "LETO_WARMUP_MIB")
    monkeypatch.delenv("LETO_WARMUP_MIB")
    assert warmup.cap_of(types.SimpleNamespace(ctx=Context.from_env(under))) == \
        (warmup.DEFAULT_MIB << 20, "the default")
