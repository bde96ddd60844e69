"""benchmarks/recovery/launch.py: a system's run directory holds that launch's outputs only.  A
step record left by an earlier run in the same --work-dir was read as this run's (its first step
set the kill times: "training started -55281.6 s after launch" on the CPU machine, 2026-11-30)."""
from __future__ import annotations

import json
import os
import sys

import pytest

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


def test_the_update_phase_is_predicted_from_the_last_steps_phase_times_or_its_length():
    from benchmarks.recovery.launch import UPDATE_AT, update_target
    rec = {"t0": 10.0, "t1": 10.6, "phases": {"fwd": {"s": 0.1}, "bwd": {"s": 0.2},
                                             "opt": {"s": 0.3}}}
    assert update_target(rec, now=10.6) == pytest.approx(10.6 + 0.1 + 0.2 + 0.15)
    assert update_target(rec, now=11.1) == pytest.approx(11.05 + 0.6)   # past: the next step's
    bare = {"t0": 10.0, "t1": 11.0}
    assert update_target(bare, now=0.0) == pytest.approx(11.0 + UPDATE_AT)


# A trainer of three phases of 0.2 s each; before its update it logs when that update began.
PHASED_TRAINER = """
import json, os, sys, time
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
f = open(os.path.join(d, 'steps_0.jsonl'), 'a', buffering=1)
for step in range(100):
    t0 = time.monotonic(); time.sleep(0.2); t = time.monotonic(); time.sleep(0.2)
    u = time.monotonic()
    f.write(json.dumps({'ev': 'update', 'rank': 0, 'pid': os.getpid(), 't': u}) + '\\n')
    time.sleep(0.2); t1 = time.monotonic()
    ph = {'fwd': {'s': t - t0}, 'bwd': {'s': u - t}, 'opt': {'s': t1 - u}}
    f.write(json.dumps({'ev': 'step', 'rank': 0, 'pid': os.getpid(), 'gen': 0, 'step': step,
                        't0': t0, 't1': t1, 'phases': ph}) + '\\n')
"""


def test_a_kill_aimed_at_the_update_phase_lands_in_it(tmp_path):
    """A real process, a real SIGKILL: its own log says whether it was in its update (the
    window is 0.2 s, the aim its middle, so the harness's polling and a loaded machine's late
    wake-ups stay well inside it)."""
    run_dir = tmp_path / "sys"
    steps = run_dir / "steps"
    for offset in (1.0, 1.33):               # two due times a third of a step apart
        ln = run_system([sys.executable, "-c", PHASED_TRAINER, str(steps)], dict(os.environ),
                        str(run_dir), [(offset, 0)], timeout_s=60, kill_phase="update")
        (k,) = ln.kills
        assert k.t_fault is not None and k.aimed_at is not None, k
        began = max(r["t"] for r in ln.records if r["ev"] == "update" and r["t"] <= k.t_fault)
        ended = [r["t1"] for r in ln.records if r["ev"] == "step" and r["t1"] >= began]
        assert not ended, "the kill came after the update it aimed at had finished"
        assert k.t_fault - began < 0.2, (k.t_fault - began, k)
