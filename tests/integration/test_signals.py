"""Signals sent to leto-run reach the workers; after the grace period no descendant survives,
including a grandchild that ignores SIGTERM, one that escaped with setsid(), and after a
`kill -9` of the agent itself."""
import os
import signal
import subprocess
import time

import pytest

from leto_testing import ROOT, SCRIPTS, base_env, events, leto_cmd, pid_alive


def start(out_dir, *args, ev=None):
    cmd = leto_cmd("--no-status", "--nproc-per-node", "2", *(["--events", str(ev)] if ev else []),
                   *args)
    return subprocess.Popen(cmd, env=base_env(out_dir), cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_files(out_dir, names, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all((out_dir / n).exists() for n in names):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{names} not written")


def all_pids(out_dir):
    pids = []
    for r in (0, 1):
        pids += [int(x) for x in (out_dir / f"pids_{r}").read_text().split()]
    return pids


def wait_dead(pids, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_term_stops_everything_after_grace(out_dir, sig):
    p = start(out_dir, "--shutdown-timeout", "2", str(SCRIPTS / "tree.py"), "--escape",
              "--escape-fork")
    try:
        wait_files(out_dir, ["pids_0", "pids_1"])
        pids = all_pids(out_dir)
        t0 = time.monotonic()
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
        assert p.returncode == 128 + sig, err[-2000:]
        # Grandchildren ignore SIGTERM: they are only gone because the grace ran out.
        assert 1.5 <= took < 15, (took, err[-3000:])
        assert wait_dead(pids, 5) == []
    finally:
        p.kill()


def test_kill_9_of_agent_leaves_nothing(out_dir):
    """Escaped descendants too: the guardian finds them by the job token in their
    /proc/PID/environ -- a forked one's is the agent's, which re-executed itself with it."""
    p = start(out_dir, str(SCRIPTS / "tree.py"), "--ignore-term", "--escape", "--escape-fork")
    try:
        wait_files(out_dir, ["pids_0", "pids_1"])
        pids = all_pids(out_dir)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        # Workers die of their parent-death signal, grandchildren by the guardian.
        assert wait_dead(pids, 10) == []
    finally:
        p.kill()


def test_usr1_is_forwarded_and_job_continues(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    p = start(out_dir, "--signals-to-handle", "SIGTERM,SIGUSR1", "--shutdown-timeout", "1",
              str(SCRIPTS / "tree.py"), ev=ev)
    try:
        wait_files(out_dir, ["pids_0", "pids_1"])
        p.send_signal(signal.SIGUSR1)
        wait_files(out_dir, ["usr1_0", "usr1_1"], timeout=10)
        time.sleep(0.3)
        assert p.poll() is None            # USR1 is a notice (Slurm), not a stop
        # only the active workers got it: state managers (no handler) and shadows did not
        for r in (0, 1):
            active = int((out_dir / f"pids_{r}").read_text().split()[0])
            assert (out_dir / f"usr1_by_{r}").read_text().split() == [str(active)]
        stopped = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        assert p.returncode == 128 + signal.SIGTERM
        evs = events(ev)
        assert [e["signal"] for e in evs if e["event"] == "signal"] == ["SIGUSR1", "SIGTERM"]
        assert not [e for e in evs if e["event"] in ("sm_gone", "sm_restart", "shadow_exit")
                    and e["mono"] < stopped], "a signal meant for the job killed a helper process"
    finally:
        p.kill()


def test_second_ctrl_c_skips_the_grace(out_dir):
    p = start(out_dir, "--shutdown-timeout", "60", str(SCRIPTS / "tree.py"), "--ignore-term")
    try:
        wait_files(out_dir, ["pids_0", "pids_1"])
        pids = all_pids(out_dir)
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=20)           # far less than the 60 s grace
        assert wait_dead(pids, 5) == []
    finally:
        p.kill()
