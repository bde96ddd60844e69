"""`job.state_dict()` / `job.load_state_dict()` / `job.steps(n, start=k)` (plain mode, no
agent): a run saved at step k with torch.distributed.checkpoint and resumed by a new job
equals the uninterrupted run bit for bit (losses, parameters, torch's optimizer state dict),
with the stock step (what torchrun runs) and with RMU's (`LETO_PLAIN_RMU=1`), and a checkpoint
written by one resumes under the other: the format is torch's."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from leto_runtime import runtime
from leto_testing import plain_job

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from byo_model import ByoNet, byo_init, freeze, groups, make_optimizer, tokens  # noqa: E402

TOTAL, AT = 8, 3


def _job(monkeypatch, rmu: bool):
    job = plain_job(monkeypatch, rmu=rmu)
    with job.meta_init():
        model = ByoNet()
    model = job.retain(model, init=byo_init)
    freeze(model)
    topt, sched = make_optimizer("adamw", groups(model, lr2=2e-3))
    return job, model, job.optimizer(topt, sched, clip_grad_norm=0.5)


def _train(job, model, opt, total, start=None):
    losses = []
    for step in job.steps(total, start=start):
        _, loss = model(*tokens(step))
        losses.append((loss.item(), [g["lr"] for g in opt.param_groups]))   # what the script sees
        loss.backward()
        opt.step()
    return losses


@pytest.fixture
def cleanup():
    yield
    runtime.current().forget_job()


@pytest.mark.parametrize("save_rmu,load_rmu", [(False, False), (True, True), (False, True),
                                               (True, False)],
                         ids=["stock", "rmu", "stock->rmu", "rmu->stock"])
def test_a_checkpointed_run_resumes_bit_exactly(monkeypatch, cleanup, tmp_path, save_rmu, load_rmu):
    job, model, opt = _job(monkeypatch, load_rmu)
    full = _train(job, model, opt, TOTAL)
    want_params = [p.detach().clone() for p in model.parameters()]
    want_opt = opt.state_dict()

    job, model, opt = _job(monkeypatch, save_rmu)
    first = _train(job, model, opt, AT)
    dcp.save(job.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))

    job, model, opt = _job(monkeypatch, load_rmu)
    template = job.state_dict()                 # copies: dcp.load writes into them
    dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    job.load_state_dict(template)
    rest = _train(job, model, opt, TOTAL)
    assert first + rest == full
    for a, b in zip(model.parameters(), want_params):
        assert torch.equal(a, b)
    got = opt.state_dict()
    assert got["param_groups"] == want_opt["param_groups"]
    for i, st in want_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)


def test_a_start_other_than_the_checkpoint_s_step_is_refused(monkeypatch, cleanup):
    job, model, opt = _job(monkeypatch, rmu=True)
    with pytest.raises(ValueError, match=r"start=2\): the optimizer's state is that of step 0 "
                                         r"\(none loaded\).*start at 0"):
        _train(job, model, opt, TOTAL, start=2)
