"""The agent owns the LETO_* worker contract: a value in the agent's own environment never
reaches a worker (a stale LETO_JOB_KEY made every restart-mode trainer fail its contract
check), while the user's tuning knobs (settings.py) still do."""
import os
import re
import subprocess
import sys

import pytest

from leto_run.worker_env import CONTRACT_VARIABLES, build_worker_env
from leto_runtime import Context
from leto_runtime.wire import settings
from tests.unit.test_worker_env_unit import spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _protocol_table() -> set[str]:
    """The LETO_* variables docs/PROTOCOL.md lists for the worker environment."""
    text = open(os.path.join(ROOT, "docs", "PROTOCOL.md")).read()
    return set(re.findall(r"^\| `(LETO_[A-Z0-9_]+)` \|", text, re.M))


def test_every_documented_contract_variable_is_owned_by_the_agent():
    documented = _protocol_table()
    assert "LETO_JOB_KEY" in documented and "LETO_SM_SOCKET" in documented
    assert documented <= CONTRACT_VARIABLES


@pytest.mark.parametrize("recovery", ["restart", "inplace"])
def test_no_contract_variable_comes_from_the_agent_s_environment(recovery):
    # expectation: what the worker gets when the agent's environment has none of them
    s = spec(recovery=recovery)
    clean = build_worker_env({"PATH": "/bin"}, s)
    stale = {v: f"stale-{v}" for v in CONTRACT_VARIABLES | _protocol_table()}
    got = build_worker_env({"PATH": "/bin", **stale}, s)
    owned = {k: v for k, v in got.items() if k.startswith("LETO_")}
    assert owned == {k: v for k, v in clean.items() if k.startswith("LETO_")}
    assert not any(v.startswith("stale-") for v in got.values())


def test_the_agent_s_values_win_where_it_sets_them():
    key = "ab" * 32
    env = build_worker_env({"LETO_JOB_KEY": "zz", "LETO_SM_SOCKET": "/old.sock"},
                           spec(recovery="inplace", job_key=key, sm_socket="/r/sm.sock"))
    assert env["LETO_JOB_KEY"] == key and env["LETO_SM_SOCKET"] == "/r/sm.sock"


def test_a_stale_job_key_no_longer_breaks_a_restart_mode_trainer():
    env = build_worker_env({"LETO_JOB_KEY": "zz"}, spec(recovery="restart"))
    Context.from_env(env)      # raised ContractError ("install the same Leto version")


def test_user_tuning_knobs_still_reach_the_workers():
    knobs = {v: "1" for v in settings.VARIABLES}
    assert not set(knobs) & CONTRACT_VARIABLES
    env = build_worker_env(knobs, spec())
    assert {k: env.get(k) for k in knobs} == knobs


def test_leto_run_restart_mode_ignores_an_exported_job_key(tmp_path):
    """End to end: the red team's reproduction (it exited 1 with a worker ContractError)."""
    env = dict(os.environ, LETO_JOB_KEY="zz", LETO_SM_SOCKET=str(tmp_path / "none.sock"))
    p = subprocess.run([sys.executable, "-m", "leto_run", "--recovery", "restart",
                        "--log-dir", str(tmp_path / "logs"),
                        os.path.join(ROOT, "examples", "toy_train.py")],
                       env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
