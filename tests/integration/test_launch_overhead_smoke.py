"""Smoke test of benchmarks/launch_overhead.py: it runs end to end against both launchers, and
leto-run's crash detection stays event driven.

The bound: every leto-run sample of kill -> agent ``failure_detected`` must be under 50 ms.  That
is generous for CI noise (the agent reaps via a pidfd, ~1-2 ms on the 2-core dev machine), but a
launcher that polls exit codes every 100 ms like torchrun lands uniformly in [0, 100) ms, so it
passes one sample with probability ~1/2 and all four with ~1/16.  Four repeats instead of
--quick's two, for that reason, of leto-run alone: only they measure against a bound, so only
they hold the machine (`alone`); one trial of each launcher, beside other tests, checks the
report's figures.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "launch_overhead.py"
REPEATS = 4
BOUND_S = 0.050


def _bench(tmp_path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out), "--timeout", "30", *args],
        cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, json.loads(out.read_text())


def test_launch_overhead_runs_both_launchers(tmp_path):
    """The benchmark end to end, one trial per launcher: every figure it promises, for both."""
    stdout, report = _bench(tmp_path, "--repeats", "1")
    assert "| start-up: launch -> all ranks |" in stdout
    for launcher in ("leto-run", "torchrun"):
        mine = [t for t in report["trials"] if t["launcher"] == launcher]
        assert len(mine) == 1, f"{launcher}: {len(mine)} trials"
        t = mine[0]
        # Start-up: positive, and ranks start after the launcher (same monotonic clock).
        assert 0 < t["first_rank_s"] <= t["all_ranks_s"] < 30, t
        assert 0 < t["survivor_sigterm_s"] < 30, t
    assert report["summary"]["all_ranks_s"]["ratio"] is not None
    assert {g["goal"] for g in report["goals"]} and \
        all(isinstance(g["ok"], bool) for g in report["goals"])


@pytest.mark.alone          # it measures detection against a bound
def test_leto_run_s_detection_is_event_driven(tmp_path):
    _, report = _bench(tmp_path, "--only", "leto-run", "--repeats", str(REPEATS))
    trials = report["trials"]
    assert len(trials) == REPEATS and all(t["launcher"] == "leto-run" for t in trials)
    detect = [t["agent_detect_s"] for t in trials]
    assert all(d is not None and 0 < d < BOUND_S for d in detect), \
        f"leto-run kill -> failure_detected (s): {detect}; bound {BOUND_S}"
    # The launcher-agnostic figure (the survivor's SIGTERM) includes the stop path too; hold
    # its median to the same bound.
    react = report["summary"]["survivor_sigterm_s"]["leto-run"]["median"]
    assert react < BOUND_S, f"leto-run kill -> survivor SIGTERM median {react * 1e3:.1f} ms"
    goals = [g["goal"] for g in report["goals"]]         # none that needs torchrun's trials
    assert len(goals) == 1 and goals[0].endswith("(agent's failure_detected)"), goals
