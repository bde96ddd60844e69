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
    assert calls == [False]                              # under no_grad
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert torch.equal(rng, torch.get_rng_state())
    # without the restore the forward would have changed both (the oracle is not vacuous)
    model(torch.randn(4, 8))
    assert not all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert warmup.run(job) is None and len(calls) == 1   # once per process


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
