"""`job.optimizer(torch_opt, scheduler, clip_grad_norm)` against stock torch (plain mode, no
agent): the same model trained by the same torch optimizer and scheduler with
`clip_grad_norm_` and `opt.step()` by hand is the oracle.  Both of Leto's paths are checked:
plain mode's stock step (what torchrun runs) and RMU's chunked update on local tensors
(`LETO_PLAIN_RMU=1`, the arithmetic leto-run runs) -- bit for bit in every loss, every
group's lr, the final parameters and torch's `state_dict()` of the optimizer."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from leto_runtime import runtime
from leto_testing import plain_job
from leto_runtime.torch_optim import UnsupportedOptimizer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from byo_model import ByoNet, byo_init, freeze, groups, make_optimizer, tokens  # noqa: E402

STEPS = 7
CLIP = 0.5


def _plain_job(monkeypatch, rmu: bool, device: str = "cpu"):
    return plain_job(monkeypatch, rmu=rmu, device=device)


@pytest.fixture
def cleanup():
    yield
    runtime.current().forget_job()


def _leto(monkeypatch, kind: str, rmu: bool, chunk_pages: int = 0, device: str = "cpu"):
    if chunk_pages:
        monkeypatch.setenv("LETO_CHUNK_PAGES", str(chunk_pages))
    job = _plain_job(monkeypatch, rmu, device)
    with job.meta_init():
        model = ByoNet()
    model = job.retain(model, init=byo_init)
    freeze(model)
    topt, sched = make_optimizer(kind, groups(model, lr2=2e-3 if kind != "sgd" else 0.02))
    opt = job.optimizer(topt, sched, clip_grad_norm=CLIP)
    losses, lrs = [], []
    for step in job.steps(STEPS):
        _, loss = model(*(x.to(device) for x in tokens(step)))
        losses.append(loss.item())
        loss.backward()
        opt.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return job, model, opt, losses, lrs


def _stock(kind: str, device: str = "cpu"):
    ref = ByoNet()
    byo_init(ref, 3)
    ref.to(device)
    freeze(ref)
    topt, sched = make_optimizer(kind, groups(ref, lr2=2e-3 if kind != "sgd" else 0.02))
    trainable = [p for g in topt.param_groups for p in g["params"]]
    losses, lrs = [], []
    for step in range(STEPS):
        topt.zero_grad()
        _, loss = ref(*(x.to(device) for x in tokens(step)))
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP, foreach=False)
        topt.step()
        sched.step()
        lrs.append([g["lr"] for g in topt.param_groups])
    return ref, topt, losses, lrs


def _same_state_dict(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert v.dtype == w.dtype and torch.equal(v.cpu(), w.cpu()), (i, k)


@pytest.mark.parametrize("rmu", [False, True], ids=["stock", "rmu"])
@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_the_script_s_optimizer_matches_stock_torch_bitwise(monkeypatch, cleanup, kind, rmu):
    job, model, opt, losses, lrs = _leto(monkeypatch, kind, rmu)
    ref, topt, ref_losses, ref_lrs = _stock(kind)
    assert losses == ref_losses and len(set(losses)) == STEPS
    assert lrs == ref_lrs and len({tuple(x) for x in lrs}) > 1      # the scheduler moved
    for (n, a), (m, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == m and torch.equal(a, b), n
    assert torch.equal(model.frozen.weight, ref.frozen.weight)      # frozen: never updated
    _same_state_dict(opt.state_dict(), topt.state_dict())


def test_groups_cut_by_small_chunks_give_the_same_bits(monkeypatch, cleanup):
    """Chunks smaller than a group's element range (one page each) split the groups' segments
    anywhere: the update is the same."""
    _, model, _, losses, _ = _leto(monkeypatch, "adamw", rmu=True, chunk_pages=1)
    ref, _, ref_losses, _ = _stock("adamw")
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def _model(monkeypatch):
    job = _plain_job(monkeypatch, rmu=True)
    with job.meta_init():
        model = ByoNet()
    return job, job.retain(model, init=byo_init)


def test_an_optimizer_that_is_not_elementwise_is_refused_with_the_supported_ones(monkeypatch, cleanup):
    job, model = _model(monkeypatch)
    with pytest.raises(UnsupportedOptimizer, match=r"RMSprop is not supported; Leto supports "
                                                   r"torch.optim.AdamW, torch.optim.Adam and "
                                                   r"torch.optim.SGD.*element-wise"):
        job.optimizer(torch.optim.RMSprop(model.parameters()))


def test_a_trainable_parameter_outside_the_groups_is_refused(monkeypatch, cleanup):
    job, model = _model(monkeypatch)
    with pytest.raises(ValueError, match=r"parameter 'frozen.weight' requires grad but is in no "
                                         r"param group"):
        job.optimizer(torch.optim.AdamW([model.emb.weight, model.mix.weight, model.mix.bias,
                                         model.norm.weight, model.norm.bias], foreach=False))


def test_a_metric_driven_scheduler_is_refused(monkeypatch, cleanup):
    job, model = _model(monkeypatch)
    topt = torch.optim.AdamW(model.parameters(), foreach=False)
    with pytest.raises(UnsupportedOptimizer, match=r"ReduceLROnPlateau is not supported: "
                                                   r"opt.step\(\) calls scheduler.step\(\) "
                                                   r"without arguments"):
        job.optimizer(topt, torch.optim.lr_scheduler.ReduceLROnPlateau(topt))


class Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 2)
        self.spare = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def test_a_parameter_without_a_gradient_stops_the_step_with_its_name(monkeypatch, cleanup):
    """Stock torch skips a parameter whose grad is None; one step count for all cannot."""
    job = _plain_job(monkeypatch, rmu=True)
    with job.meta_init():
        model = Unused()
    model = job.retain(model)
    opt = job.optimizer(torch.optim.AdamW(model.parameters(), foreach=False))
    with pytest.raises(ValueError, match=r"parameters spare.weight, spare.bias got no gradient "
                                         r"in step 0.*requires_grad_\(False\)"):
        for _ in job.steps(1):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()


def test_zero_grad_of_the_model_is_refused_with_the_fix(monkeypatch, cleanup):
    """model.zero_grad() (set_to_none) would leave the retained gradients at zero and the
    update would use them: stopped instead."""
    job = _plain_job(monkeypatch, rmu=True)
    with job.meta_init():
        model = ByoNet()
    model = job.retain(model, init=byo_init)
    opt = job.optimizer(torch.optim.AdamW(model.parameters(), foreach=False))
    with pytest.raises(ValueError, match=r"is no longer its view of retained memory in step 0: "
                                         r"model.zero_grad\(\)"):
        for step in job.steps(2):
            model.zero_grad()
            model(*tokens(step))[1].backward()
            opt.step()


def test_freezing_after_the_optimizer_is_refused(monkeypatch, cleanup):
    job = _plain_job(monkeypatch, rmu=True)
    with job.meta_init():
        model = ByoNet()
    model = job.retain(model, init=byo_init)
    opt = job.optimizer(torch.optim.AdamW(model.parameters(), foreach=False))
    model.mix.requires_grad_(False)
    with pytest.raises(ValueError, match=r"frozen or unfrozen after job.optimizer\(\)"):
        for step in job.steps(1):
            model(*tokens(step))[1].backward()
            opt.step()


class Unpicklable:
    """An lr_lambda object holding a lock: LambdaLR's state_dict() carries its __dict__."""

    def __init__(self):
        import threading
        self.lock = threading.Lock()

    def __call__(self, step):
        return 1.0


def test_a_scheduler_whose_state_cannot_be_pickled_is_refused(monkeypatch, cleanup):
    job, model = _model(monkeypatch)
    topt = torch.optim.AdamW(model.parameters(), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, Unpicklable())
    with pytest.raises(UnsupportedOptimizer, match=r"the scheduler's state_dict\(\) cannot be "
                                                   r"pickled .*picklable objects"):
        job.optimizer(topt, sched)
