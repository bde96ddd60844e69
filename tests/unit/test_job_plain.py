"""The runtime API without leto-run (plain mode: ordinary tensors, the same RMU code) against
an independent oracle: torch.optim.AdamW(foreach=False) + clip_grad_norm_ on a normally built
model.  Losses and parameters must be bit-identical."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt import GPT, GPTConfig, batch, init_weights  # noqa: E402

import leto_runtime.job as J  # noqa: E402
from leto_runtime import runtime  # noqa: E402
from leto_testing import plain_env, plain_job  # noqa: E402
from leto_runtime.rmu.adamw import AdamWConfig, lr_at  # noqa: E402
from leto_runtime.rmu.states import FOLD_PAGES  # noqa: E402


@pytest.fixture(name="plain_job")
def _plain_job(monkeypatch):
    yield plain_job(monkeypatch)
    runtime.current().forget_job()


def test_plain_job_matches_torch_adamw_bitwise(plain_job):
    job = plain_job
    cfg = GPTConfig.tiny()
    with job.meta_init():
        model = GPT(cfg)
    assert next(model.parameters()).is_meta
    model = job.retain(model, init=init_weights)
    ac = AdamWConfig(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=0.5,
                     warmup_steps=2, total_steps=10, min_lr=2e-4)
    opt = job.adamw(model, ac)
    losses = []
    for step in job.steps(10):
        _, loss = model(*batch(3, step, 0, 4, cfg, "cpu"))
        losses.append(loss.item())
        loss.backward()
        opt.step()
    assert job.role == "plain"

    ref = GPT(cfg)
    init_weights(ref, 3)
    o = torch.optim.AdamW(ref.parameters(), lr=ac.lr, betas=ac.betas, weight_decay=ac.weight_decay,
                          foreach=False)
    ref_losses = []
    for step in range(10):
        torch.manual_seed(job.step_seed(step))
        _, loss = ref(*batch(3, step, 0, 4, cfg, "cpu"))
        ref_losses.append(loss.item())
        o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), ac.clip_grad_norm, foreach=False)
        for g in o.param_groups:
            g["lr"] = lr_at(ac, step)
        o.step()
    assert losses == ref_losses
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    states = job.state_tensors()
    ea = torch.cat([o.state[p]["exp_avg"].reshape(-1) for p in ref.parameters()])
    got = torch.cat([states["leto/exp_avg"][s.offset:s.offset + s.numel] for s in job.layout.params])
    assert torch.equal(got, ea)


def test_a_finished_job_is_freed_and_its_states_fit_the_model(monkeypatch):
    """A job nobody references any more is collected with its states (its fault hooks live
    on the parameters, held from C++, and must not keep it alive), and a small model's
    states are sized to the model: the undo buffers are capped at the model's pages, not a
    full protection group's."""
    import gc
    import weakref
    refs = []
    for _ in range(2):
        job = plain_job(monkeypatch)
        with job.meta_init():
            model = torch.nn.Linear(8, 4)
        model = job.retain(model)
        opt = job.adamw(model, lr=1e-2)
        for _ in job.steps(2):
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
        ss = job.ss
        pages = ss.model[0].n_pages
        assert ss.chunk_pages <= pages
        assert ss.undo.n_pages == 6 * ss.chunk_pages + FOLD_PAGES      # + the fold's counts
        assert [ss.chunks(g) for g in range(len(ss.model[0].groups))] == [[(0, pages)]]
        refs.append(weakref.ref(job))
        del job, model, opt, ss
        runtime.current().forget_job()
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_step_must_call_opt_step(plain_job):
    job = plain_job
    with job.meta_init():
        model = torch.nn.Linear(4, 3)
    model = job.retain(model)
    job.adamw(model, lr=1e-2)
    with pytest.raises(RuntimeError, match="opt.step"):
        for _ in job.steps(3):
            pass


def _clean_env(monkeypatch):
    plain_env(monkeypatch)


def _loaded_at_first_heartbeat(monkeypatch, ctx):
    """(what the parity loader holds when Job sends its first heartbeat, the Job), from a fresh
    process's state (nothing loaded)."""
    from leto_runtime import beats as hb
    from leto_runtime.parity import _ext
    monkeypatch.setattr(_ext, "_cache", {})
    seen = []
    monkeypatch.setattr(hb, "heartbeat", lambda step=None: seen.append(set(_ext._cache)))
    runtime.current().forget_job()
    try:
        job = J.Job(ctx, backend=None, seed=3, device="cpu", transactions=True)
    finally:
        runtime.current().forget_job()
    assert seen, "Job sent no heartbeat at start-up"
    return seen[0], job


def test_an_inplace_job_builds_the_kernels_before_the_first_heartbeat(monkeypatch):
    """The first heartbeat arms leto-run's hang detection, so the native kernels -- compiled on
    a machine's first run, about a minute on CPU -- must be ready before it: on a fresh machine
    the README's demo (--hang-timeout 10 s) had its trainers killed as hung while they compiled.
    The process group and the agent's store are not what is tested (no agent here): stubbed."""
    import dataclasses

    from leto_runtime import promotion
    from leto_runtime.context import Context

    _clean_env(monkeypatch)
    monkeypatch.setattr(J.Job, "_init_pg", lambda self: setattr(self, "pg", None))
    monkeypatch.setattr(promotion, "announce_inplace", lambda detail=None: None)
    ctx = dataclasses.replace(Context.from_env({}), under_leto=True, sm_socket="/nonexistent",
                              recovery="inplace")
    assert "cpu" in _loaded_at_first_heartbeat(monkeypatch, ctx)[0], "the C++ codec was not loaded"


def test_a_plain_job_loads_no_kernel(monkeypatch):
    """Plain torchrun retains nothing, so it protects nothing: no kernel is loaded (nor built,
    nor a compiler needed -- tests/integration/test_plain_torchrun_no_build.py runs it for real)."""
    from leto_runtime.wire import kernel_cache
    from leto_runtime.context import Context
    from leto_runtime.parity import _ext

    _clean_env(monkeypatch)
    monkeypatch.setattr(kernel_cache, "_outcomes", {})
    loaded, job = _loaded_at_first_heartbeat(monkeypatch, Context.from_env({}))
    assert loaded == set() and job.role == "plain"
    with job.meta_init():
        model = torch.nn.Linear(8, 4)
    model = job.retain(model)
    opt = job.adamw(model, lr=1e-2)
    for step in job.steps(2):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
    assert _ext._cache == {} and kernel_cache._outcomes == {}


def test_kernels_prepare_reports_what_it_cannot_build_and_never_raises(monkeypatch):
    """On this CPU-only torch, preparing for a CUDA device finds the CUDA kernels unavailable and
    says why, skips what the settings turn off, and raises nothing: the code that needs a kernel
    reports its absence itself, when and if it needs it."""
    from leto_runtime import kernels

    monkeypatch.setenv("LETO_LEND", "0")
    monkeypatch.setenv("LETO_RMU_FUSED", "0")
    monkeypatch.setenv("LETO_RMU_STREAM_MARKER", "0")
    monkeypatch.setenv("LETO_RMP_MAP", "python")
    got = kernels.prepare("cpu")
    assert got == {"parity_cpu": "ready"}
    if torch.cuda.is_available():
        pytest.skip("the CUDA kernels are available here")
    got = kernels.prepare("cuda", retained=True)
    assert got["parity_cpu"] == "ready"
    assert got["parity_cuda"].startswith("ParityBackendUnavailable") and "CUDA" in got["parity_cuda"]
    assert got["rmu_cuda"] == got["lend_alloc"] == "not used"
    assert set(got) == {"parity_cpu", "parity_cuda", "rmu_cuda", "lend_alloc", "rmp_map"}
    assert kernels.prepare("cuda", retained=False).keys() == {"parity_cpu", "parity_cuda", "rmu_cuda",
                                                               "lend_alloc"}



def test_the_exit_teardown_frees_the_process_group_before_finalization(monkeypatch):
    """The atexit teardown (`job._destroy_group`) leaves no ProcessGroup object alive: one the
    job still referenced was freed in interpreter finalization, where gloo's teardown aborted
    the process at random (SIGABRT, "terminate called without an active exception", about 1
    run in 13 of examples/byo_train.py under torchrun on 2 ranks)."""
    import gc
    import sys
    import torch.distributed as dist
    from leto_testing import free_port, plain_job
    from leto_runtime import job as J
    from leto_runtime import runtime
    job = plain_job(monkeypatch, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                    WORLD_SIZE="1", RANK="0")
    try:
        assert dist.is_initialized() and job.pg is not None
        pg = job.pg
        J._destroy_group()
        gc.collect()
        # (ProcessGroup objects are not tracked by the gc: count the references instead)
        assert not dist.is_initialized() and job.pg is None
        assert sys.getrefcount(pg) == 2, "something still holds the destroyed group"
    finally:
        J._destroy_group()
        runtime.current().forget_job()
