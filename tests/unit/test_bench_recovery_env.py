"""benchmarks/recovery: a runtime knob reaches leto-run's workers only through `--leto-env`.
The harness drops LETO_* variables of its own environment (so nothing changes a system behind
the report's back); `LETO_WARMUP_MIB=3072 python -m benchmarks.recovery ...` therefore ran at
the default cap, unnoticed (2026-12-06, eighth session)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.recovery import presets, systems
from benchmarks.recovery.run import parse_args
from leto_testing import ROOT


def test_a_knob_of_the_harness_s_own_environment_is_dropped(monkeypatch):
    monkeypatch.setenv("LETO_WARMUP_MIB", "3072")
    env = systems.environment(presets.get("cpu-smoke"))
    assert "LETO_WARMUP_MIB" not in env


def test_leto_env_reaches_leto_run_and_not_torchrun(monkeypatch):
    monkeypatch.delenv("LETO_WARMUP_MIB", raising=False)
    a = parse_args(["--leto-env", "LETO_WARMUP_MIB=4096", "--leto-env", "LETO_REHEARSE=0"])
    preset = presets.get("cpu-smoke", leto_env=a.leto_env_pairs)
    base = systems.environment(preset)
    leto = [s for s in systems.ALL_FAULTED if s.launcher == systems.LETO]
    others = [s for s in systems.ALL_FAULTED if s.launcher != systems.LETO] + [systems.REFERENCE]
    assert leto and others
    for s in leto:
        env = systems.launcher_env(s, base, preset.leto_env)
        assert env["LETO_WARMUP_MIB"] == "4096" and env["LETO_REHEARSE"] == "0"
    for s in others:
        assert "LETO_WARMUP_MIB" not in systems.launcher_env(s, base, preset.leto_env)


@pytest.mark.parametrize("spec, why", [("LETO_FOO=1", "not a runtime knob"),
                                       ("LETO_WARMUP_MIB", "want NAME=VALUE"),
                                       ("CUDA_HOME=/x", "not a runtime knob")])
def test_a_wrong_leto_env_is_refused_before_anything_runs(spec, why, tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.recovery", "--leto-env", spec,
                        "--work-dir", str(tmp_path / "w")], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and why in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "w").exists()
