"""The agent runs one state manager per slot (in-place mode): retained memory outlives the
trainers, a crashed state manager is restarted from the fds the agent kept, page faults can be
injected from the CLI, and nothing is left behind."""
import os
import signal
import subprocess
import time

from leto_testing import ROOT, SCRIPTS, base_env, events, leto_cmd, pid_alive, run


def sm_spawns(ev):
    return [e for e in events(ev) if e["event"] == "spawn" and e["role"] == "state_manager"]


def test_retained_memory_survives_a_group_restart(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "--max-restarts", "1",
                     "--events", str(ev), "--inject", "kill:rank=1:step=5",
                     str(SCRIPTS / "retain.py"), "restart"), base_env(out_dir), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "ok attempt 1"
    spawns = sm_spawns(ev)
    assert len(spawns) == 2                        # the state managers outlived the restart
    assert all(not pid_alive(e["pid"]) for e in spawns)


def test_state_manager_crash_is_restarted_from_kept_fds(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    p = subprocess.Popen(leto_cmd("--no-status", "--nproc-per-node", "2", "--events", str(ev),
                                  str(SCRIPTS / "retain.py"), "smcrash"),
                         env=base_env(out_dir), cwd=str(ROOT), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while not all((out_dir / f"written_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < end and p.poll() is None, p.stderr.read()[-3000:] if p.poll() is not None else "timeout"
            time.sleep(0.05)
        victim = [e for e in sm_spawns(ev) if e["local_rank"] == 1][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        while not any(e["event"] == "sm_restart" for e in events(ev)):
            assert time.monotonic() < end
            time.sleep(0.05)
        (out_dir / "go").touch()
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
    finally:
        p.kill()
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text().startswith("ok"), rank
    restart = [e for e in events(ev) if e["event"] == "sm_restart"][0]
    assert restart["old_pid"] == victim and restart["local_rank"] == 1
    respawn = [e for e in sm_spawns(ev) if e["local_rank"] == 1][-1]
    assert respawn["restores"] >= 1 or respawn["pid"] != victim


def test_pages_injection_from_the_cli(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    # Step-triggered, so the pages exist when the fault strikes (a time-triggered one could
    # fire while the trainer still imports torch on a loaded machine, into an empty pool).
    r = run(leto_cmd("--no-status", "--events", str(ev), "--shutdown-timeout", "2",
                     "--inject", "pages:rank=0:tier=device:count=1:step=3",
                     "--inject", "kill:rank=0:step=6",
                     str(SCRIPTS / "retain.py"), "restart"), base_env(out_dir), timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    inj = [e for e in events(ev) if e["event"] == "inject" and e["spec"].startswith("pages")]
    assert inj and inj[0]["rank"] == 0 and inj[0]["step"] == 3, inj
    assert "injected fault: 1 data page(s) of state 'params.0' (device memory)" in r.stderr


def test_restart_mode_runs_no_state_manager(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--recovery", "restart", "--events", str(ev),
                     str(SCRIPTS / "fail_until.py"), "0"), base_env(out_dir))
    assert r.returncode == 0 and sm_spawns(ev) == []
