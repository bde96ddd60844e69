"""The `leto-run` command: help, exit codes and one-line errors, pass-through, --print-config.

The agent is never started: error paths fail before it, `--print-config` exits before it, and
the two tests of the hand-off replace `leto_run.agent` with a fake module.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from leto_run import errors as E
from leto_run.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def invoke(args, env=None):
    return CliRunner().invoke(cli, list(args), obj={"env": env or {}})


def printed(args, env=None) -> dict:
    r = invoke(["--print-config", *args], env)
    assert r.exit_code == 0, r.output
    return yaml.safe_load(r.stdout)


def test_help_lists_every_option_grouped():
    r = invoke(["--help"])
    assert r.exit_code == 0
    out = r.stdout
    assert out.startswith("Usage: leto-run [OPTIONS] TRAINING_SCRIPT [SCRIPT_ARGS]...")
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                 "--rdzv-conf", "--standalone", "--max-restarts", "--monitor-interval",
                 "--start-method", "--role", "-m, --module", "--no-python", "--run-path",
                 "--log-dir", "-r, --redirects", "-t, --tee", "--local-ranks-filter",
                 "--node-rank", "--master-addr", "--master-port", "--local-addr",
                 "--signals-to-handle", "--shutdown-timeout", "--event-log-handler",
                 "--logs-specs", "--numa-binding", "--duplicate-stdout-filters",
                 "--duplicate-stderr-filters", "--virtual-local-rank", "--config", "--recovery",
                 "--hang-timeout", "--inject", "--events", "--status/--no-status",
                 "--exit-barrier-timeout", "--print-config"):
        assert flag in out, flag
    for text in ("PET_NPROC_PER_NODE", "LETO_HANG_TIMEOUT", "Rendezvous (YAML section",
                 "Accepted for torchrun compatibility", "Precedence:", "Exit codes:"):
        assert text in out, text
    assert "--nproc_per_node" not in out          # aliases accepted but not cluttering help
    assert invoke(["-h"]).stdout == out


@pytest.mark.parametrize("args, needle", [
    (["--nnodes", "4:2", "t.py"], "launch.nnodes (--nnodes): '4:2'"),
    (["--no-python", "-m", "pkg"], "launch.module (--module)"),
    (["--rdzv-backend", "bogus", "t.py"], "rendezvous.backend (--rdzv-backend)"),
    (["--inject", "kill:rank=5:after=1", "t.py"], "inject[0] (--inject)"),
    ([], "launch.training_script (command line): no training script given"),
])
def test_config_errors_exit_2_with_one_line(args, needle):
    r = invoke(args)
    assert r.exit_code == E.EXIT_USAGE
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("leto-run: error: "), r.stderr
    assert needle in lines[0] and " -- fix: " in lines[0]
    assert r.stdout == ""


def test_env_errors_name_the_variable():
    r = invoke(["t.py"], {"PET_NNODES": "0"})
    assert r.exit_code == 2 and "launch.nnodes (PET_NNODES)" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--bogus", "t.py"], "No such option '--bogus'"),
    (["--nproc-per-nod", "2", "t.py"], "--nproc-per-node"),
    (["--max-restarts"], "requires an argument"),
])
def test_usage_errors_exit_2_with_one_line(args, needle):
    r = invoke(args)
    assert r.exit_code == E.EXIT_USAGE
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("leto-run: error: ") and needle in lines[0]


def test_print_config_and_passthrough():
    d = printed(["--nproc_per_node", "2", "--max-restarts", "1", "t.py", "--lr", "3", "--help",
                 "-m"])
    assert d["launch"]["script_args"] == ["--lr", "3", "--help", "-m"]
    assert d["launch"]["nproc_per_node"] == "2" and d["launch"]["max_restarts"] == 1
    assert d["launch"]["module"] is False
    # torchrun's single-node rule is printed as its input (test_print_config_roundtrip.py), and
    # what it resolves to as a comment
    assert d["rendezvous"]["backend"] == "static" and d["rendezvous"]["master_port"] is None
    r = invoke(["--print-config", "t.py"])
    assert "# resolves to: c10d rendezvous on localhost:0 (torchrun's single-node rule)" in r.stdout


def test_print_config_without_script_is_allowed():
    assert printed([])["launch"]["training_script"] == ""


def test_double_dash_separates_script():
    assert printed(["--", "t.py", "--x"])["launch"]["script_args"] == ["--x"]


@pytest.fixture
def fake_agent(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")         # the script preflight finds (not run: no agent)
    calls = []
    mod = types.ModuleType("leto_run.agent")
    mod.result = 0

    def run_job(cfg, start=None):
        calls.append(cfg)
        if isinstance(mod.result, BaseException):
            raise mod.result
        return mod.result
    mod.run_job = run_job
    monkeypatch.setitem(sys.modules, "leto_run.agent", mod)
    return mod, calls


def test_hands_config_to_agent_and_exits_with_its_code(fake_agent):
    mod, calls = fake_agent
    mod.result = 1
    r = invoke(["--nproc-per-node", "2", "--master-addr", "h", "t.py", "a"])
    assert r.exit_code == 1
    (cfg,) = calls
    assert cfg.launch.script_args == ("a",) and cfg.launch.nproc_int == 2
    assert "leto-run: warning: --master-addr is only used" in r.stderr


@pytest.mark.parametrize("exc, code", [
    (E.WorkersFailed("boom", exhausted=True), E.EXIT_RESTARTS_EXHAUSTED),
    (E.Unrecoverable("lost"), E.EXIT_UNRECOVERABLE),
    (E.StoppedBySignal(15), 128 + 15),
    (E.RendezvousFailed("timeout"), E.EXIT_WORKER_FAILED),
])
def test_leto_errors_map_to_their_exit_codes(fake_agent, exc, code):
    mod, _ = fake_agent
    mod.result = exc
    r = invoke(["t.py"])
    assert r.exit_code == code
    assert r.stderr.startswith("leto-run: error: ")


def test_precedence_end_to_end_in_a_subprocess(tmp_path):
    """defaults < YAML < env < CLI, through the real console entry (`python -m leto_run`)."""
    job = tmp_path / "job.yaml"
    job.write_text("launch:\n  training_script: y.py\n  max_restarts: 1\n  role: yaml\n"
                   "  nproc_per_node: 2\nrecovery:\n  hang_timeout: 5\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "LETO_", "TORCH_ELASTIC"))}
    env.update(PET_MAX_RESTARTS="2", PET_ROLE="env", LETO_CONFIG=str(job),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "leto_run", "--print-config", "--role", "cli"],
                       env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    d = yaml.safe_load(p.stdout)
    assert d["launch"]["training_script"] == "y.py"        # YAML
    assert d["launch"]["nproc_per_node"] == "2"             # YAML over default
    assert d["launch"]["max_restarts"] == 2                 # env over YAML
    assert d["launch"]["role"] == "cli"                     # CLI over env
    assert d["recovery"]["hang_timeout"] == 5.0
    p = subprocess.run([sys.executable, "-m", "leto_run", "--nnodes", "0", "t.py"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("leto-run: error: launch.nnodes (--nnodes)")


def test_version_names_leto_torch_and_python():
    from importlib.metadata import version
    r = invoke(["--version"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"leto-run (leto) {version('leto')}, torch {version('torch')}")
