"""Validation of the simulator against the recovery harness's measured runs (leto_sim/profile.py,
leto_sim/validate.py): the recorded results files in docs/results/ -- real runs, whose measured
ETTR the simulator does not see -- are predicted within 3 points for Leto in place and for
torchrun + DCP async; a synthetic run is reduced and replayed exactly; a malformed results file
is a typed error naming the field, and exit 2 on the command line."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from leto_sim.config import SimConfigError
from leto_sim.ettr import time_to_complete
from leto_sim.profile import load_profile, profile_from_results
from leto_sim.systems import SystemModel
from leto_sim.validate import validate_profile

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs/results"
H200 = RESULTS / "recovery_h200_20261130T0645.json"


def errors(name: str) -> dict[str, float]:
    return {v.system: v.error_points for v in validate_profile(load_profile(RESULTS / name))}


@pytest.mark.parametrize("name,systems", [
    ("recovery_cpu_20261130T0744.json", ("leto-inplace", "torchrun-dcp-async")),
    # This run measured Leto alone (issue 18's A/B, docs/BENCHMARKS.md): no torchrun to check.
    ("recovery_cpu_20261201T2217.json", ("leto-inplace",)),
    ("recovery_h200_20261130T0645.json", ("leto-inplace", "torchrun-dcp-async")),
])
def test_recorded_runs_predicted_within_3_points(name, systems):
    err = errors(name)
    for s in systems:
        assert abs(err[s]) < 3.0, (name, s, err)
    assert set(systems) <= set(err)
    if "torchrun-dcp-async" not in systems:
        assert "torchrun-dcp-async" not in err


def test_every_modelled_system_of_the_h200_run_within_3_points():
    # The other two checkpointing systems (sync DCP, leto-run restart + DCP) as well.
    err = errors(H200.name)
    assert set(err) == {"leto-inplace", "torchrun-dcp-async", "torchrun-dcp-sync",
                        "leto-restart-dcp"}
    assert all(abs(e) < 3.0 for e in err.values()), err


def test_async_commit_lag_from_the_calibration():
    # The async save's background write: done within an iteration on CPU, 148 on the H200
    # (13 GB); a sync save is usable when it returns.
    h200 = load_profile(H200)
    lags = {s.name: s.commit_lag for s in h200.systems if s.kind == "checkpoint"}
    assert lags == {"torchrun-dcp-async": 148, "leto-restart-dcp": 148, "torchrun-dcp-sync": 0}
    assert load_profile(RESULTS / "recovery_cpu_20261130T0744.json").async_commit_lag == 1


def synthetic() -> dict:
    """A run by hand: 1 s iterations, async DCP every 4 with a 0.5 s stall, a kill at 6.7 s
    (6 iterations done, checkpoint 4 usable) with I = 2 s, 10 iterations: T_eval 15.2 s."""
    rows = [[0, 0.0, 1.0], [1, 1.0, 2.0], [2, 2.0, 3.0], [3, 3.0, 4.5], [4, 4.5, 5.5],
            [5, 5.5, 6.5], [4, 8.7, 9.7], [5, 9.7, 10.7], [6, 10.7, 11.7], [7, 11.7, 13.2],
            [8, 13.2, 14.2], [9, 14.2, 15.2]]
    timeline = [[k, a, b, "async" if k in (3, 7) else None, 1 if a < 6.7 else 2]
                for k, a, b in rows]
    return {"benchmark": "recovery", "preset": {"name": "hand"}, "date_utc": "x",
            "reference": {"steps": 10, "T_ref": 10.0,
                          "calibration": {"sync_cost_s": 0.6, "async_cost_s": 0.5}},
            "systems": {"torchrun-dcp-async": {
                "mode": "dcp", "ckpt": "async", "interval": 4, "label": "hand",
                "step": 9, "ettr": 10.0 / 15.2, "complete": True, "timeline": timeline,
                "failures": [{"at_s": 6.7, "I": 2.0}]}}}


def test_synthetic_run_reduced_and_replayed_exactly():
    p = profile_from_results(synthetic())
    (s,) = p.systems
    assert (p.t_ref, s.step, s.stall, s.interval, s.commit_lag) == (1.0, 1.0, 0.5, 4, 1)
    assert s.warmup == pytest.approx(0.0) and s.downtime == pytest.approx(2.0)
    (v,) = validate_profile(p)
    assert v.t_eval_predicted == pytest.approx(15.2)
    assert v.error_points == pytest.approx(0.0, abs=1e-9)


def test_time_to_complete_by_hand():
    # In place, 1 s iterations: a HOF at 2.5 s costs 3 s and the half-done iteration 3.
    leto = SystemModel("x", 1.0, 1.0, 0.0, 100, 3.0, 3.0, False)
    assert time_to_complete(leto, [2.5], [True], 5) == pytest.approx(8.5)
    # A failure after the last completion changes nothing.
    assert time_to_complete(leto, [5.5], [True], 5) == pytest.approx(5.0)
    # A synchronous save (commit lag 0) is usable at once: the failure at 4.5 s after
    # checkpoint 4 loses only the iteration in flight.
    sync = SystemModel("x", 1.0, 1.0, 0.0, 4, 1.0, 1.0, True, 0)
    assert time_to_complete(sync, [4.5], [False], 6) == pytest.approx(7.5)
    lagged = SystemModel("x", 1.0, 1.0, 0.0, 4, 1.0, 1.0, True, 1)
    assert time_to_complete(lagged, [4.5], [False], 6) == pytest.approx(11.5)


def broken(change) -> dict:
    raw = copy.deepcopy(synthetic())
    change(raw)
    return raw


@pytest.mark.parametrize("change,field", [
    (lambda r: r.update(benchmark="other"), "benchmark"),
    (lambda r: r["reference"].pop("T_ref"), "reference.T_ref"),
    (lambda r: r["reference"].update(steps=0), "reference.steps"),
    (lambda r: r["systems"]["torchrun-dcp-async"].pop("interval"),
     "systems.torchrun-dcp-async.interval"),
    (lambda r: r["systems"]["torchrun-dcp-async"].update(ckpt="weekly"),
     "systems.torchrun-dcp-async.ckpt"),
    (lambda r: r["systems"]["torchrun-dcp-async"]["timeline"].__setitem__(2, [2, 3.0]),
     "systems.torchrun-dcp-async.timeline[2]"),
    (lambda r: r["systems"]["torchrun-dcp-async"]["failures"][0].update(I=-1),
     "systems.torchrun-dcp-async.failures[0].I"),
    (lambda r: r["systems"]["torchrun-dcp-async"].update(step=10),
     "systems.torchrun-dcp-async.step"),
])
def test_malformed_results_name_the_field(change, field):
    with pytest.raises(SimConfigError) as e:
        profile_from_results(broken(change))
    assert e.value.field == field


def test_unmodelled_system_is_listed_not_fatal():
    raw = broken(lambda r: r["systems"].update(other={"mode": "mystery"}))
    p = profile_from_results(raw)
    assert "other" in p.skipped and [s.name for s in p.systems] == ["torchrun-dcp-async"]


def sim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leto_sim", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_validate_command(tmp_path):
    bad = tmp_path / "bad.json"
    raw = synthetic()
    del raw["systems"]["torchrun-dcp-async"]["failures"][0]["at_s"]
    bad.write_text(json.dumps(raw))
    r = sim("validate", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert "field 'systems.torchrun-dcp-async.failures[0].at_s'" in r.stderr
    out = tmp_path / "v.json"
    r = sim("validate", str(H200), "--max-error", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "torchrun + DCP async" in r.stdout and "leto-run in place" in r.stdout
    (f,) = json.loads(out.read_text())["files"]
    assert {s["system"] for s in f["systems"]} >= {"leto-inplace", "torchrun-dcp-async"}
