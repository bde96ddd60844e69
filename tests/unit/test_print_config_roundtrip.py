"""`--print-config` output is a job file: fed back with --config it resolves to the same job.

The expectation is the first resolution itself (`load_config` of the original command line), so
the test fails for any key the printer drops, derives again differently, or spells in a form the
YAML loader rejects."""
from __future__ import annotations

import subprocess
import sys

import pytest

from leto_run.cli import load_config
from leto_run.config_print import render

CASES = [
    ["train.py"],                                                  # torchrun's single-node c10d rule
    ["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "3e-4"],
    ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "29511",
     "--rdzv-conf", "join_timeout=900", "train.py"],              # static, conf gets rank=
    ["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400",
     "--rdzv-id", "job42", "--rdzv-conf", "join_timeout=900,last_call_timeout=5", "train.py"],
    ["--recovery", "restart", "--nproc-per-node", "2", "--max-restarts", "3", "-r", "3", "-t", "0:1,1:2",
     "--local-ranks-filter", "0", "--log-dir", "/tmp/x", "--no-status", "train.py"],
    ["--nproc-per-node", "2", "--data-pages", "64", "--tier1", "4", "--tier2", "2", "--chunk-pages", "8",
     "--scrub-budget", "0", "--demote", "replace", "--hang-timeout", "5",
     "--inject", "kill:rank=1:after=5s", "--inject", "hang:rank=0:step=20", "train.py"],
    ["--nnodes", "2", "--master-port", "29500", "--master-addr", "10.0.0.7",   # a warning
     "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "train.py"],
    ["-m", "--signals-to-handle", "SIGTERM,SIGUSR1", "pkg.mod", "a b"],
]


def _keys(text: str) -> str:
    return "".join(line for line in text.splitlines(True) if not line.startswith("#"))


def _without_warnings(cfg) -> dict:
    d = cfg.to_dict()
    d.pop("warnings")
    return d


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a)[:48])
def test_printed_config_resolves_to_the_same_job(argv, tmp_path):
    first = load_config(argv, env={})
    job = tmp_path / "job.yaml"
    job.write_text(render(first))
    again = load_config(["--config", str(job)], env={})
    assert _without_warnings(again) == _without_warnings(first)
    # and printing is a fixed point: the second file says what the first said
    assert _keys(render(again)) == _keys(render(first))


def test_warnings_become_comments_not_keys():
    cfg = load_config(CASES[6], env={})
    assert cfg.warnings, "this command line must produce a loader warning"
    text = render(cfg)
    assert all(f"# warning: {w}" in text for w in cfg.warnings)
    assert "\nwarnings:" not in text and "min_nodes" not in text and "auto_c10d" not in text


def test_cli_prints_and_accepts_it(tmp_path):
    cmd = [sys.executable, "-m", "leto_run", "--standalone", "--tier1", "8", "--print-config",
           "train.py"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    job = tmp_path / "job.yaml"
    job.write_text(r.stdout)
    r2 = subprocess.run([sys.executable, "-m", "leto_run", "--config", str(job), "--print-config"],
                        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout == r.stdout
