"""In-place recovery with one rank per GPU and NCCL between real peers (issue 24, item 1): the
cases that need at least two visible GPUs, each bit-exact against torchrun on the same GPUs.
Skipped, with the reason, where fewer are visible (the lent single-GPU kinds, CI).

Run on a multi-GPU kind (`nvidia-h100-x2` or larger): `pytest -q -rA tests/gpu/test_multigpu.py`,
with `-n` at most the number of GPU pairs (each xdist worker takes a pair of its own through
CUDA_VISIBLE_DEVICES; `_env`).
Every inject spec below is parsed by leto-run's own parser in CI
(tests/unit/test_gpu_inject_specs.py), so a typo cannot cost device time.

What each case shows: kills in forward, backward, the gradient all-reduce, the global
synchronization and every RMU operation; page losses within the parity's tolerance with a kill;
both ranks failing in one iteration; a second failure during the recovery; a hang inside an
NCCL collective (the survivor blocked in it must leave it); survivors demoted in process
(`--demote release`: their NCCL communicator aborted, their CUDA context kept)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from leto_testing import (ROOT, base_env, compare_runs, events, leto_cmd, run,  # noqa: E402
                          torchrun_cmd)

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
STEPS = 12
WORLD = 2
# The single-GPU tests' model (tests/gpu/test_inplace_gpu.py): ~7.2M parameters, 14 pages of
# 2 MiB per state -> protection groups of 8 and 6 pages.
MODEL = ["--model", "small", "--n-layer", "4", "--n-embd", "384", "--steps", str(STEPS)]
GEOM = ["--data-pages", "8", "--tier1", "8", "--tier2", "1", "--chunk-pages", "2"]

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} visible CUDA GPUs (one rank per GPU with NCCL)")

CASES = {
    "forward": (["kill:rank=1:step=3:at=forward"],),
    "backward": (["kill:rank=0:step=3:at=backward"],),
    "grads.allreduce": (["kill:rank=1:step=4:at=grads.allreduce"],),
    "sync": (["kill:rank=1:step=5:at=sync"],),
    "sync.after": (["kill:rank=0:step=5:at=sync.after"],),
    "rmu.load": (["kill:rank=1:step=4:at=rmu.load:group=1"],),
    "rmu.undo": (["kill:rank=0:step=4:at=rmu.undo:group=0:chunk=1"],),
    "rmu.update+garbage": (["kill:rank=1:step=4:at=rmu.update:group=1:chunk=1:garbage=1"],),
    "rmu.delta+garbage": (["kill:rank=0:step=4:at=rmu.delta:group=0:chunk=2:garbage=1"],),
    "rmu.commit": (["kill:rank=1:step=4:at=rmu.commit:group=0:chunk=2"],),
    "rmu.writeback": (["kill:rank=0:step=5:at=rmu.writeback:group=0"],),
    "rmu.tier2": (["kill:rank=1:step=5:at=rmu.tier2:group=1"],),
    "pages+kill": ([
        "pages:rank=1:step=4:at=rmu.update:tier=device:group=1:first=0:count=6",
        "pages:rank=1:step=4:at=rmu.update:tier=host:part=p1:group=1:first=2:count=1",
        "kill:rank=1:step=4:at=rmu.update:group=1:chunk=1:garbage=1"],),
    "both-ranks-one-iteration": (["kill:rank=0:step=4:at=rmu.commit:group=0:chunk=2",
                                  "kill:rank=1:step=4:at=rmu.delta:group=1:chunk=0:garbage=1"],),
    "second-failure-during-recovery": (["kill:rank=1:step=5:at=rmu.writeback:group=0",
                                        "kill:rank=0:step=0:gen=1:at=recovery.reconstruct"],),
    "hang-in-nccl-collective": (["hang:rank=1:step=6:at=grads.allreduce"],),
    "release-two-hofs": (["kill:rank=1:step=3:at=backward",
                          "kill:rank=1:step=8:gen=1:at=rmu.update:garbage=1"],
                         ["--demote", "release"]),
}


def _env() -> dict[str, str]:
    """This xdist worker's own GPUs (worker k: GPUs WORLD*k ... WORLD*k + WORLD - 1), so that
    parallel workers never share a device; one worker (or none) uses the first WORLD."""
    w = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    k = int(w[2:]) if w.startswith("gw") and w[2:].isdigit() else 0
    n = torch.cuda.device_count()
    if WORLD * (k + 1) > n:
        pytest.fail(f"xdist worker {w} has no {WORLD} GPUs of its own ({n} visible): run with "
                    f"-n {max(1, n // WORLD)} at most")
    return base_env(CUDA_VISIBLE_DEVICES=",".join(str(WORLD * k + i) for i in range(WORLD)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ref_multigpu")
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", str(WORLD), SCRIPT, *MODEL,
                         "--out", str(d)), _env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_per_gpu_recovers_in_place_bit_exactly(case, reference, tmp_path):
    injects, *extra = CASES[case]
    ev = tmp_path / "events.jsonl"
    # short only where a hang is injected: a busy GPU machine's start-up can take longer
    hang_s = "15" if any(s.startswith("hang:") for s in injects) else "60"
    args = ["--standalone", "--nproc-per-node", str(WORLD), *GEOM, "--hang-timeout", hang_s,
            "--events", str(ev), "--log-dir", str(tmp_path / "logs"), *(extra[0] if extra else [])]
    for s in injects:
        args += ["--inject", s]
    p = run(leto_cmd(*args, SCRIPT, *MODEL, "--out", str(tmp_path)), _env(), timeout=900)
    report = p.stderr[p.stderr.find("Recovery report"):]
    print(f"\n=== {case} (world {WORLD}, one GPU each) ===\n{report}")
    assert p.returncode == 0, p.stderr[-5000:]
    compare_runs(reference, tmp_path, WORLD, range(STEPS), case)
    evs = events(ev)
    assert any(e["event"] == "promote" for e in evs)
    # every rank trained on its own GPU with NCCL (not gloo on a shared one)
    spawns = [e for e in evs if e["event"] == "spawn" and e.get("role") == "active"
              and e["generation"] == 0]
    assert sorted(e["rank"] for e in spawns) == list(range(WORLD))
    if "--demote" in args:
        done = [e for e in evs if e["event"] == "demoted"]
        print("demoted:", [{k: e.get(k) for k in ("generation", "rank", "agent_seconds")}
                           for e in done])
        assert done, "no survivor was demoted in process"
