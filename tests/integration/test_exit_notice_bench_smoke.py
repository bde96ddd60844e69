"""Smoke test of benchmarks/exit_notice.py: one trial end to end, its table printed, the killed
process's status in it (timing is the benchmark's, not a test's: docs/BENCHMARKS.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_exit_notice_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.exit_notice", "--repeats", "1",
                        "--mem-gib", "0.25", "--json", str(out)], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| verified |" in p.stdout and "| pidfd |" in p.stdout, p.stdout
    [t] = json.loads(out.read_text())["trials"]
    assert t["status"] == -9 and min(t["notice_s"], t["verified_s"], t["pidfd_s"]) > 0, t
