"""Smoke test of benchmarks/fork_server.py: one run of a small job each way (the server forked
from the agent, the same preloading torch._dynamo and DCP although the script uses neither, the
server exec'd, no server), the table and the JSON it promises, the event
log's count of forked workers (all of them with a fork server, none without) and how the server
started.  No ratio is asserted (2 shared CPU cores)."""
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
    assert "| fork / exec |" in p.stdout and "| fork / exec-server |" in p.stdout
    assert "| fork / fork-preload-all |" in p.stdout
    res = json.loads(out.read_text())
    [fork], [every], [server], [plain] = (res["runs"][n] for n in
                                          ("fork", "fork-preload-all", "exec-server", "exec"))
    assert fork["workers"] == every["workers"] == server["workers"] == plain["workers"] == 2
    assert fork["forked"] == every["forked"] == server["forked"] == 2 and plain["forked"] == 0
    assert (fork["server"], server["server"], plain["server"]) == ("inherit", "exec", "none")
    assert every["server"] == "inherit +torch._dynamo +torch.distributed.checkpoint"
    assert fork["cpu_s"] > 0 and plain["cpu_s"] > 0 and fork["wall_s"] > 0
