"""The restrictions docs/PORTING.md lists that concern DDP and the time before `job.steps()`,
each with the error a user meets (plain mode in process, a one-rank gloo group for DDP).  The
other restrictions' errors are tested next to their code: test_retain_modules.py,
test_adopted.py, test_torch_optim.py, tests/integration/test_byo_exactness.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import leto_runtime.job as J
from leto_runtime import modules, runtime
from leto_testing import free_port, plain_env


@pytest.fixture
def job1(monkeypatch):
    """A plain job of one rank over a gloo group the script made itself (adopted by init())."""
    plain_env(monkeypatch, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
              WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")
    try:
        yield J.init(seed=3, device="cpu")
    finally:
        runtime.current().forget_job()
        dist.destroy_process_group()


def _model(job):
    with job.meta_init():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = job.retain(model)
    opt = job.optimizer(torch.optim.AdamW(model.parameters(), foreach=False))
    return model, opt


def test_init_adopts_the_script_s_own_process_group(job1):
    assert job1.pg is dist.group.WORLD and job1.world_size == 1


def test_ddp_with_gradients_as_bucket_views_is_refused(job1):
    model, opt = _model(job1)
    net = DDP(model, init_sync=False, gradient_as_bucket_view=True)
    with pytest.raises(ValueError, match=r"gradient_as_bucket_view=True\) makes the gradients "
                                         r"views of DDP's buckets.*gradient_as_bucket_view=False"):
        for _ in job1.steps(1):
            net(torch.ones(2, 4)).sum().backward()
            opt.step()


def test_a_step_whose_gradients_ddp_never_averaged_is_refused(job1):
    model, opt = _model(job1)
    net = DDP(model, init_sync=False)
    with pytest.raises(RuntimeError, match=r"step 0: the model's last forward ran under DDP's "
                                           r"no_sync\(\).*outside no_sync\(\)"):
        for _ in job1.steps(1):
            with net.no_sync():
                net(torch.ones(2, 4)).sum().backward()
            opt.step()


def test_ddp_is_used_and_trains_like_stock_torch(job1):
    """One rank: DDP's averaging is the identity, so the run equals stock AdamW."""
    model, opt = _model(job1)
    net = DDP(model, init_sync=False)
    for _ in job1.steps(3):
        net(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert job1._ddp_sync is True


def test_ddp_on_three_ranks_in_place_needs_a_fixed_bucket_order(job1):
    model, _ = _model(job1)
    rebuilt = DDP(model, init_sync=False)
    fixed = DDP(model, init_sync=False, find_unused_parameters=True)
    why = modules.ddp_problem(rebuilt, inplace=True, world_size=3)
    assert why is not None and "find_unused_parameters=True" in why and "3+ ranks" in why
    assert modules.ddp_problem(fixed, inplace=True, world_size=3) is None
    assert modules.ddp_problem(rebuilt, inplace=True, world_size=2) is None   # a + b == b + a
    assert modules.ddp_problem(rebuilt, inplace=False, world_size=3) is None  # torchrun


def test_lending_is_held_until_ddp_has_rebuilt_its_buckets(job1):
    """DDP without find_unused_parameters rebuilds (allocates) its buckets in its second
    forward; memory allocated then lives as long as DDP, so activation lending (CUDA) is held
    until the rebuild happened: the pure rule over a real DDP that trains."""
    model, opt = _model(job1)
    net = DDP(model, init_sync=False)
    seen = []
    for _ in job1.steps(3):
        seen.append(modules.ddp_rebuild_pending(net))
        net(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert seen == [True, True, False]
    assert not modules.ddp_rebuild_pending(DDP(model, init_sync=False,
                                               find_unused_parameters=True))


def test_writes_into_parameters_before_the_steps_fail_loudly(job1):
    """Until job.steps() binds them, parameters are placeholders: a pretrained
    load_state_dict (or DDP's init_sync broadcast) cannot land anywhere -- values go in
    retain(init=...)."""
    model, _ = _model(job1)
    sd = {k: torch.ones_like(v, device="cpu").expand(v.shape).clone() for k, v in
          torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).state_dict().items()}
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor "
                                           "refers to a single memory location"):
        model.load_state_dict(sd)
