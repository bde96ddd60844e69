"""benchmarks/recovery/launch.py: a system's run directory holds that launch's outputs only.  A
step record left by an earlier run in the same --work-dir was read as this run's (its first step
set the kill times: "training started -55281.6 s after launch" on the CPU machine, 2026-11-30)."""
from __future__ import annotations

import json
import os
import sys

from benchmarks.recovery.launch import run_system

WRITE_ONE_STEP = ("import json, os, sys, time; d = sys.argv[1]; os.makedirs(d, exist_ok=True); "
                  "open(os.path.join(d, 'steps_0.jsonl'), 'a').write(json.dumps({'ev': 'step', "
                  "'rank': 0, 'step': 0, 't0': time.monotonic(), 't1': time.monotonic(), "
                  "'pid': os.getpid()}) + '\\n')")


def test_records_of_an_earlier_run_in_the_same_directory_are_not_this_runs(tmp_path):
    run_dir = tmp_path / "torchrun-dcp-async"
    steps = run_dir / "steps"
    steps.mkdir(parents=True)
    stale = {"ev": "step", "rank": 0, "step": 41, "t0": 1.0, "t1": 2.0, "pid": 1}
    (steps / "steps_0.jsonl").write_text(json.dumps(stale) + "\n")
    (run_dir / "events.jsonl").write_text("{}\n")
    ln = run_system([sys.executable, "-c", WRITE_ONE_STEP, str(steps)], dict(os.environ),
                    str(run_dir), [], timeout_s=60)
    assert ln.exit_code == 0
    assert [r["step"] for r in ln.records] == [0]           # this run's step only
    assert ln.t_first_step is not None and ln.t_first_step >= ln.t_launch
    assert not (run_dir / "events.jsonl").exists()
