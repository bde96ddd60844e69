"""The simulator's command line through real subprocesses: bad input exits 2 with the field
named before any simulation; the small config runs end to end (table, JSON, PNG)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "configs/sim/small.yaml"


def sim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leto_sim", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def broken_config(tmp_path: Path, change) -> Path:
    raw = yaml.safe_load(SMALL.read_text())
    change(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("args,field", [
    (["--mttf", "-10m"], "--mttf"),
    (["--mttf", "soon"], "--mttf"),
    (["--hof-ratio", "1.5"], "--hof-ratio"),
    (["--hof-ratio", "-0.2"], "--hof-ratio"),
    (["--seeds", "1"], "--seeds"),
])
def test_bad_options_exit_2(args, field, tmp_path):
    r = sim("--config", str(SMALL), *args, "--json", str(tmp_path / "out.json"))
    assert r.returncode == 2, r.stderr
    assert f"field '{field}'" in r.stderr and "fix:" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    assert not (tmp_path / "out.json").exists()     # nothing ran


@pytest.mark.parametrize("change,field", [
    (lambda r: r["failures"].update(mttf=-600), "failures.mttf"),
    (lambda r: r["failures"].update(hof_ratio=2), "failures.hof_ratio"),
    (lambda r: r["systems"].update(torchelastic={"detection": 1}), "systems.torchelastic"),
    (lambda r: r["workload"]["pipeline"]["stages"][0].update(brackets=[[0.01]]),
     "workload.pipeline.stages[0].brackets[0]"),
])
def test_bad_config_exit_2(change, field, tmp_path):
    r = sim("--config", str(broken_config(tmp_path, change)))
    assert r.returncode == 2 and f"field '{field}'" in r.stderr, r.stderr
    assert r.stdout == ""


def test_unreadable_config_exit_2(tmp_path):
    assert sim("--config", str(tmp_path / "none.yaml")).returncode == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload: [unclosed\n")
    r = sim("--config", str(bad))
    assert r.returncode == 2 and "field '--config'" in r.stderr


def test_small_config_end_to_end(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    r = sim("--config", str(SMALL), "--mttf", "10m", "--hof-ratio", "0.5", "--seeds", "4",
            "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    for name in ("leto", "gemini_plus", "checkpoint_restart"):
        assert name in r.stdout
    data = json.loads(out.read_text())
    assert data["mttf"] == 600.0 and data["hof_ratio"] == 0.5 and data["seeds"] == 4
    names = [s["name"] for s in data["systems"]]
    assert names == ["leto", "gemini_plus", "checkpoint_restart"]
    for s in data["systems"]:
        assert 0 < s["ci_low"] <= s["mean"] <= s["ci_high"] < 1 and len(s["per_seed"]) == 4
    assert [x["hof_ratio"] for x in data["hof_sweep"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "deepseek_v4"])
def test_paper_configs_run(name):
    r = sim("--config", str(ROOT / f"configs/sim/{name}.yaml"), "--seeds", "3")
    assert r.returncode == 0, r.stderr
    assert "leto" in r.stdout and "gemini_plus" in r.stdout
