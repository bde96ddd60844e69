"""Smoke test of benchmarks/first_step.py (issue 22, item 3's measurement): it runs end to end in
fresh processes on this machine's CPU with the tiny model and writes the figures it promises.
No ratio is asserted (2 shared cores); the GPU figures are in docs/BENCHMARKS.md."""
from __future__ import annotations

import json
import subprocess
import sys

from leto_testing import ROOT, base_env


def test_first_step_benchmark_runs_and_reports_each_variant(tmp_path):
    out = tmp_path / "fs.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.first_step", "--model", "tiny",
                        "--n-layer", "2", "--block-size", "32", "--batch-size", "2",
                        "--variants", "step", "--repeats", "1", "--steps", "1",
                        "--json", str(out)], cwd=str(ROOT), env=base_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"step"}        # the variant with the most code: one fresh process
    for v, rs in runs.items():
        [r] = rs
        assert r["device"] == "cpu" and r["first_s"] > 0 and r["steady_s"] > 0, (v, r)
    assert "| step |" in p.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.first_step", "--variants", "hot"],
                         cwd=str(ROOT), env=base_env(), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "variants from" in bad.stderr
