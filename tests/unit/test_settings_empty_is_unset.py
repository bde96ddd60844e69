"""An empty tuning knob is unset -- the default -- for every kind of knob (settings.KNOBS).

It used to be "off" for a switch (`LETO_EXIT_NOTICE=` turned the exit notice off) but exit 2
for a count (`LETO_RMU_LOOKAHEAD=`).  Env-var convention, torchrun's and Leto's own options'
(`config_load._env_values`): empty is unset."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leto_runtime.wire import settings as S

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = S.Settings.from_env({})


@pytest.mark.parametrize("empty", ["", "  ", "\t"])
@pytest.mark.parametrize("field", list(S.KNOBS))
def test_an_empty_knob_reads_as_unset(field, empty):
    var = S.KNOBS[field][0]
    assert getattr(S.Settings.from_env({var: empty}), field) == getattr(DEFAULTS, field)
    assert S.problems({var: empty}) == []


def test_every_knob_empty_at_once_is_the_defaults():
    assert S.Settings.from_env({v: "" for v in S.VARIABLES}) == DEFAULTS


@pytest.mark.parametrize("field", [f for f, (_, p, _) in S.KNOBS.items() if p is S._flag])
def test_a_switch_is_still_turned_off_by_a_written_no(field):
    var = S.KNOBS[field][0]
    for off in ("0", "false", "no", "off"):
        assert getattr(S.Settings.from_env({var: off}), field) is False


def test_get_and_raw_follow_the_same_rule(monkeypatch):
    monkeypatch.setenv("LETO_RMU_FOLD", "")
    monkeypatch.setenv("LETO_RMU_LOOKAHEAD", "")
    monkeypatch.setenv("LETO_SM_IDLE_TIMEOUT", "")
    s = S.get()
    assert (s.rmu_fold, s.rmu_lookahead) == (DEFAULTS.rmu_fold, DEFAULTS.rmu_lookahead)
    assert not {"LETO_RMU_FOLD", "LETO_RMU_LOOKAHEAD", "LETO_SM_IDLE_TIMEOUT"} & set(S.raw())


def test_leto_run_starts_with_empty_knobs(tmp_path):
    """The red team's case: `LETO_RMU_LOOKAHEAD=` stopped leto-run with exit 2."""
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(0)\n")
    env = dict(os.environ, LETO_RMU_LOOKAHEAD="", LETO_EXIT_NOTICE="", LETO_FORK_SERVER="")
    p = subprocess.run([sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node", "1",
                        "--log-dir", str(tmp_path / "logs"), str(script)], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
