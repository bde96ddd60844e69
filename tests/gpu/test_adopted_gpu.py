"""`job.optimizer` on CUDA against stock torch on the same GPU (`foreach=False`), bit for bit:
RMU's per-group update in plain mode (`LETO_PLAIN_RMU=1`, the CPU test's twin,
tests/unit/test_adopted.py: AdamW groups in the fused kernel, Adam and SGD in torch ops), and
examples/byo_train.py recovered in place under leto-run against torchrun."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_adopted import _leto, _same_state_dict, _stock, STEPS, cleanup  # noqa: E402,F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_the_script_s_optimizer_matches_stock_torch_on_cuda(monkeypatch, cleanup, kind):  # noqa: F811
    # Deterministic cuBLAS for both runs, this test's alone (the worker's later tests keep
    # their own process state: tests/conftest.py checks it).
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        job, model, opt, losses, lrs = _leto(monkeypatch, kind, rmu=True, device="cuda")
        ref, topt, ref_losses, ref_lrs = _stock(kind, device="cuda")
    finally:
        torch.use_deterministic_algorithms(was)
    assert losses == ref_losses and lrs == ref_lrs and len(set(losses)) == STEPS
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    _same_state_dict(opt.state_dict(), topt.state_dict())


def test_adamw_groups_run_in_the_fused_kernel(monkeypatch, cleanup):  # noqa: F811
    """With parameter groups the update of each AdamW group is the fused kernel checked for its
    values (not the torch-ops fallback), and the run above's bits are that kernel's."""
    from leto_runtime.rmu import fused as F
    job, *_ = _leto(monkeypatch, "adamw", rmu=True, device="cuda")
    assert job.device.index is not None, "a bare 'cuda' resolves to this rank's GPU"
    ops = job.updater.chunks
    assert ops.group_kernel is not None, "no fused kernel for parameter groups on CUDA"
    kernels = [ops.group_kernel(h) for h in job.updater.plan.hypers]
    assert all(k is not None for k in kernels), F.why_not


# In place under leto-run on the GPU, against torchrun on the same GPU: the script's own AdamW
# with its groups (fused per group), at world 1 (NCCL) and on two gloo ranks under DDP.
BYO = ["--steps", "10", "--width", "1024", "--opt", "adamw", "--device", "cuda"]
BYO_GEOM = ["--data-pages", "2", "--tier1", "2", "--tier2", "1", "--chunk-pages", "1"]
BYO_CASES = {
    "nccl-update+garbage": (1, [], ["kill:rank=0:step=3:at=rmu.update:group=1:chunk=1:garbage=1",
                                    "kill:rank=0:step=6:gen=1:at=backward"]),
    "gloo2-ddp": (2, ["--ddp"], ["kill:rank=1:step=2:at=rmu.delta:group=0:chunk=1:garbage=1",
                                 "kill:rank=0:step=5:gen=1:at=sync.after"]),
}


@pytest.mark.parametrize("case", list(BYO_CASES))
def test_byo_script_recovers_in_place_on_gpu_bit_exactly(case, tmp_path):
    from leto_testing import (ROOT, base_env, compare_runs, events, leto_cmd, run,
                              torchrun_cmd)
    world, extra, injects = BYO_CASES[case]
    script = str(ROOT / "examples" / "byo_train.py")
    ref, out = tmp_path / "ref", tmp_path / "leto"
    ref.mkdir()
    out.mkdir()
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", str(world), script, *BYO, *extra,
                         "--out", str(ref)), base_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    ev = tmp_path / "events.jsonl"
    args = ["--standalone", "--nproc-per-node", str(world), *BYO_GEOM, "--hang-timeout", "30",
            "--events", str(ev), "--no-status"]
    for s in injects:
        args += ["--inject", s]
    p = run(leto_cmd(*args, script, *BYO, *extra, "--out", str(out)), base_env(), timeout=600)
    print(f"\n=== byo {case} ===\n{p.stderr[p.stderr.find('Recovery report'):]}")
    assert p.returncode == 0, p.stderr[-5000:]
    compare_runs(ref, out, world, range(10), p.stderr[-3000:])
    assert {e["generation"] for e in events(ev) if e["event"] == "promote"} == {1, 2}


def _fallback_on_gpu(tmp_path, label: str, steps: int, every: int, injects, step_time: str,
                     *leto_extra: str) -> list[dict]:
    """examples/byo_train.py on one GPU (NCCL, world size 1): torchrun's fault-free run, then
    leto-run with `--checkpoint-every every` and `injects`; every step and the final state
    bit-exact against torchrun.  Returns the leto run's events."""
    from leto_testing import (ROOT, base_env, compare_runs, events, leto_cmd, run,
                              torchrun_cmd)
    script = str(ROOT / "examples" / "byo_train.py")
    ref, out, ck, ev = tmp_path / "ref", tmp_path / "leto", tmp_path / "ck", tmp_path / "ev.jsonl"
    ref.mkdir()
    out.mkdir()
    args = ["--steps", str(steps), *BYO[2:]]
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", "1", script, *args, "--out",
                         str(ref)), base_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    inject = [a for spec in injects for a in ("--inject", spec)]
    p = run(leto_cmd("--standalone", "--nproc-per-node", "1", "--data-pages", "4", "--tier1",
                     "2", "--tier2", "1", "--chunk-pages", "2", "--hang-timeout", "30",
                     "--events", str(ev), "--no-status", "--checkpoint-dir", str(ck),
                     "--checkpoint-every", str(every), *leto_extra, *inject,
                     script, *args, "--step-time", step_time, "--out", str(out)),
            base_env(), timeout=600)
    print(f"\n=== {label} ===\n{p.stderr[p.stderr.find('Recovery report'):]}")
    assert p.returncode == 0, p.stderr[-5000:]
    compare_runs(ref, out, 1, range(steps), p.stderr[-3000:])
    return events(ev)


def test_byo_script_falls_back_to_its_checkpoint_on_gpu_bit_exactly(tmp_path):
    """On the GPU (NCCL, world size 1): a HOF inside an update is recovered in place, then 3
    device pages of a group with tolerance 2 are lost: the job falls back to the checkpoint of
    step 6 (written from CUDA state by rank 0 beside training), redoes the steps after it, and
    ends bit-exact against torchrun on the same GPU."""
    from leto_testing import of
    evs = _fallback_on_gpu(tmp_path, "byo fallback", 10, 3,
                           ["kill:rank=0:step=4:at=rmu.update:group=0:chunk=1:garbage=1",
                            "pages:rank=0:count=3:tier=device:step=8:gen=1"], "0.3")
    [fb] = of(evs, "fallback")
    assert fb["step"] == 6, fb


def test_the_shadow_s_checkpoint_from_gpu_memory_is_exact(tmp_path):
    """On the GPU (NCCL, world size 1): the checkpoint of step 10 is the shadow's (it copied
    retained device memory into its own device staging while the active computed step 10,
    then wrote it from host memory); a HOF in step 11's update is recovered in place, 3 device
    pages of a group with tolerance 2 are lost at step 12, and the job falls back to the
    shadow's checkpoint, redoes 10.. and ends bit-exact against torchrun on the same GPU."""
    from leto_testing import of
    evs = _fallback_on_gpu(tmp_path, "shadow checkpoint", 14, 5,
                           ["kill:rank=0:step=11:at=rmu.update:group=0:chunk=1:garbage=1",
                            "pages:rank=0:count=3:tier=device:step=12:gen=1"], "1.0",
                           "--checkpoint-writer", "shadow")
    [fb] = of(evs, "fallback")
    assert fb["step"] == 10, fb
    [c10] = [e for e in of(evs, "phase", phase="checkpoint") if e.get("path") and
             e["step"] == 10 and e["mono"] < fb["mono"]]
    assert (c10["by"], c10["staging"]) == ("shadow", "device"), c10
