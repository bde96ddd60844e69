"""Smoke test of benchmarks/fork_server.py: one run of a small job each way (forked, exec), the
table and the JSON it promises, and the event log's count of forked workers (all of them with
the fork server, none without).  No ratio is asserted (2 shared CPU cores)."""
from __future__ import annotations

import json
import subprocess
import sys

from leto_testing import ROOT, SCRIPTS, base_env


def test_fork_server_bench_runs_both_variants(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"launch:\n  training_script: {SCRIPTS / 'procprobe.py'}\n"
                   "  nproc_per_node: 2\nrecovery:\n  mode: restart\n")
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.fork_server", "--repeats", "1",
                        "--config", str(cfg), "--json", str(out)], cwd=str(ROOT),
                       env=base_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| fork / exec |" in p.stdout
    res = json.loads(out.read_text())
    [fork], [plain] = res["runs"]["fork"], res["runs"]["exec"]
    assert fork["workers"] == plain["workers"] == 2
    assert fork["forked"] == 2 and plain["forked"] == 0
    assert fork["cpu_s"] > 0 and plain["cpu_s"] > 0 and fork["wall_s"] > 0
