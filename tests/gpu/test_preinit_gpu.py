"""Preinitialization levels on the GPU (issue 21; docs/PREINIT.md): shadows moved L3 -> L1 -> L2
-> L3 during a run with a HOF at each level, world size 1 with NCCL, bit-exact against torchrun
on the same GPU; what each shadow held on the device at its level, as the driver accounts it
(NVML, sampled every 50 ms during the run): nothing at L1, the context at L2, more at L3.  And
the agent's NVML binding (`leto_run.nvml`) against torch's own figures for this process."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]

BYO = ["--steps", "12", "--width", "1024", "--opt", "adamw", "--device", "cuda"]
SCHEDULE = ("kill:rank=0:step=2",
            "preinit:rank=0:step=3:gen=1:level=L1", "kill:rank=0:step=5:gen=1:at=sync",
            "preinit:rank=0:step=6:gen=2:level=L2", "kill:rank=0:step=7:gen=2:at=rmu.update",
            "preinit:rank=0:step=8:gen=3:level=L3", "kill:rank=0:step=10:gen=3")


def test_nvml_sees_what_this_process_holds():
    from leto_run.nvml import Nvml
    nv = Nvml.open()
    assert nv is not None, "no NVML on a machine with a CUDA GPU"
    dev = nv.physical(torch.cuda.current_device())
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    total, free = nv.memory(dev)
    t_free, t_total = torch.cuda.mem_get_info()
    # NVML's total counts what the driver reserves for itself; free is the same figure
    assert total >= t_total and abs(free - t_free) < (64 << 20), (total, free, t_total, t_free)
    mine = nv.process_bytes(dev).get(os.getpid())
    if mine is not None:        # (a container may hide pids from the driver)
        assert mine >= torch.cuda.memory_reserved() >= x.numel()
    del x


def test_shadows_at_every_level_recover_bit_exactly_and_hold_their_level_s_memory(tmp_path):
    from benchmarks.preinit_recovery import Sampler, shadow_memory
    from leto_testing import ROOT, base_env, compare_runs, events, leto_cmd, of, run, torchrun_cmd
    script = str(ROOT / "examples" / "byo_train.py")
    ref, out = tmp_path / "ref", tmp_path / "leto"
    ref.mkdir()
    out.mkdir()
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", "1", script, *BYO, "--out",
                         str(ref)), base_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    ev = tmp_path / "events.jsonl"
    args = ["--standalone", "--nproc-per-node", "1", "--data-pages", "2", "--tier1", "2",
            "--tier2", "1", "--chunk-pages", "1", "--hang-timeout", "120", "--events", str(ev),
            "--no-status"]
    for s in SCHEDULE:
        args += ["--inject", s]
    sampler = Sampler()
    sampler.start()
    p = run(leto_cmd(*args, script, *BYO, "--out", str(out)), base_env(), timeout=900)
    sampler.stop.set()
    print(f"\n=== preinit levels on the GPU ===\n{p.stderr[p.stderr.find('Recovery report'):]}")
    assert p.returncode == 0, p.stderr[-5000:]
    compare_runs(ref, out, 1, range(12), p.stderr[-3000:])
    evs = events(ev)
    for gen, level in {2: "L1", 3: "L2", 4: "L3"}.items():
        assert {e["level"] for e in of(evs, "promote", generation=gen)} == {level}, gen
    held = shadow_memory(sampler, evs)
    print(f"shadow GPU memory by level (MiB, NVML): {held}")
    assert held.get("L1") and max(held["L1"]) == 0, held
    assert held.get("L2") and held.get("L3") and 0 < max(held["L2"]) < min(held["L3"]), held


SPIKE_MIB = 4096


def _spike_run(tmp_path, reclaim: bool):
    """examples' model under leto-run (shadow at L3, auto); the device filled by this process
    so that the active's 4 GiB spike fits only once the shadow's memory is given back."""
    import json
    import subprocess
    import time
    from leto_testing import ROOT, base_env, leto_cmd
    out, go, ev = tmp_path / "out", tmp_path / "go", tmp_path / "events.jsonl"
    out.mkdir(parents=True)
    env = base_env()
    if not reclaim:
        env["LETO_RECLAIM"] = "0"
    cmd = leto_cmd("--standalone", "--nproc-per-node", "1", "--no-status", "--events", str(ev),
                   "--hang-timeout", "120", str(ROOT / "tests" / "gpu" / "scripts" /
                                                "spike_train.py"),
                   "--go", str(go), "--out", str(out), "--spike-mib", str(SPIKE_MIB))
    proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ballast = None
    try:
        deadline = time.monotonic() + 300
        def ready() -> bool:
            evs = []
            for x in (ev.read_text().splitlines() if ev.exists() else []):
                try:
                    evs.append(json.loads(x))
                except ValueError:
                    pass            # a line being written
            return (out / "ready").exists() and any(
                e["event"] == "shadow_ready" and e.get("level") == "L3" for e in evs)
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, "never reached the spike"
            time.sleep(0.1)
        torch.zeros(1, device="cuda")
        free0 = torch.cuda.mem_get_info()[0]
        ballast = torch.empty(free0 - ((SPIKE_MIB - 1000) << 20), dtype=torch.uint8,
                              device="cuda")
        torch.cuda.synchronize()
        left = torch.cuda.mem_get_info()[0] >> 20
        assert left < SPIKE_MIB - 500, left
        go.write_text("go")
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        del ballast
        torch.cuda.empty_cache()
    evs = [json.loads(x) for x in ev.read_text().splitlines()]
    return proc.returncode, stderr, evs, left


def test_a_sudden_spike_takes_the_shadow_s_memory_instead_of_an_oom(tmp_path):
    """With the reclaim hook (cuda/lend_alloc.cpp) the spike asks the agent, which relaunches
    the shadow at L1; the active's allocation then succeeds and generation 0 never fails.  The
    same run with LETO_RECLAIM=0 (the shadow holding L3, as before the controller) runs out of
    memory in generation 0 (and is then recovered in place: the spike is generation 0's)."""
    rc, err, evs, left = _spike_run(tmp_path / "on", reclaim=True)
    rec = [e for e in evs if e["event"] == "reclaim"]
    print(f"\n=== spike with reclaim: {left} MiB free before it; reclaim events {rec}")
    assert rc == 0, err[-4000:]
    assert "out of memory" not in err.lower(), err[-4000:]
    assert rec and rec[0]["levels"] == {"0": "L1"}, rec
    assert not [e for e in evs if e["event"] == "hof"], "generation 0 failed"
    rc, err, evs, left = _spike_run(tmp_path / "off", reclaim=False)
    print(f"=== spike without reclaim: {left} MiB free before it; rc {rc}")
    assert "out of memory" in err.lower(), err[-4000:]
    assert not [e for e in evs if e["event"] == "reclaim"]
