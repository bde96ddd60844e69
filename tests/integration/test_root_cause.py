"""The boxed root-cause summary names the rank that failed first, with its traceback
(from the @record error file) or its signal."""
import re

from leto_testing import SCRIPTS, base_env, events, leto_cmd, run


def root_section(stderr: str) -> str:
    return stderr.split("Root Cause (first observed failure):", 1)[1]


def test_root_cause_names_raising_rank(tmp_path, out_dir):
    r = run(leto_cmd("--no-status", "--nproc-per-node", "3", "--shutdown-timeout", "2",
                     str(SCRIPTS / "raise_error.py"), "2"), base_env(out_dir))
    assert r.returncode == 1
    root = root_section(r.stderr)
    assert re.search(r"rank\s+: 2 \(local_rank: 2", root), root
    assert "RuntimeError: boom from the planted rank" in root
    assert "exitcode  : 1" in root


def test_root_cause_is_the_killed_rank_not_its_peers(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--nproc-per-node", "3", "--events", str(ev),
                     "--inject", "kill:rank=1:step=2", str(SCRIPTS / "allreduce.py"), "--steps", "50"),
            base_env(out_dir))
    assert r.returncode == 1
    root = root_section(r.stderr)
    assert re.search(r"rank\s+: 1 \(local_rank: 1", root), root
    assert "Signal 9 (SIGKILL)" in root
    inj = [e for e in events(ev) if e["event"] == "inject"]
    assert inj and inj[0]["rank"] == 1 and inj[0]["step"] == 2


def test_time_triggered_signal_injection(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "--events", str(ev),
                     "--shutdown-timeout", "1", "--inject", "signal=SIGSEGV:rank=0:after=1s",
                     str(SCRIPTS / "tree.py")),
            base_env(out_dir))
    assert r.returncode == 1
    assert "Signal 11 (SIGSEGV)" in root_section(r.stderr)
    evs = events(ev)
    inj = [e for e in evs if e["event"] == "inject"][0]
    det = [e for e in evs if e["event"] == "failure_detected"][0]
    spawn0 = [e for e in evs
              if e["event"] == "spawn" and e["role"] == "active" and e["rank"] == 0][0]
    assert inj["by"] == "agent" and det["rank"] == 0
    assert 1.0 <= inj["mono"] - spawn0["mono"] < 3.0
    assert 0 <= det["mono"] - inj["mono"] < 0.5
