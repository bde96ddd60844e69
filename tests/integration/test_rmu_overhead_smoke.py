"""CPU smoke run of benchmarks/rmu_overhead.py (the paper's Table 1): every variant runs --
reference fused/unfused AdamW, synchronous and asynchronous snapshots, and RMU under a real
state manager (SlotHarness, memfd pages) -- and the table and JSON come out.  No performance
assertions: on CPU the figures mean nothing."""
from __future__ import annotations

import json
import subprocess
import sys

from leto_testing import ROOT, base_env


def test_rmu_overhead_cpu_smoke(tmp_path):
    out = tmp_path / "rmu.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rmu_overhead.py"),
                        "--device", "cpu", "--model", "tiny", "--batch-size", "2", "--accum", "2",
                        "--warmup", "1", "--iters", "1",
                        "--variants", "reference,sync_snapshot,async_snapshot,rmu",
                        "--json", str(out)], env=base_env(), cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["accum"] == 2 and "x 2 micro-batches" in p.stdout
    got = [r["variant"] for r in data["results"]]
    assert got == ["reference", "sync_snapshot", "async_snapshot", "rmu"]
    for r in data["results"]:
        assert r["compute_ms"] > 0 and r["update_ms"] > 0 and r["iters"] == 1
    assert "| rmu |" in p.stdout and "RMU update <= 2x" in p.stdout
    rmu = data["results"][-1]
    # the profiled iteration charges every phase of the update (one lap per operation); the
    # folded chunk (the default) makes its undo copy inside the chunk's own lap
    assert rmu["fold"] is True
    assert {"gradient parity", "global sync", "parity load/write-back", "adamw + chunk parity delta",
            "tier-2 parity", "markers"} <= set(rmu["update_breakdown_ms"])
    assert "undo copy" not in rmu["update_breakdown_ms"]
    assert rmu["fused_adamw"] is False         # CPU: the torch ops (fused.py is CUDA only)
