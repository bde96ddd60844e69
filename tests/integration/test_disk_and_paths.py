"""A full disk or a broken log directory never decides a job's fate (issue 16, items 7 and 8).

Real processes, real ENOSPC: the event log is `/dev/full`, or the next attempt's rank log files
are symlinks to it (writes fail with ENOSPC for root and for everyone else); a log root that
turns into a regular file mid-run stands for a log directory that can no longer be created.
A job that finishes every step exits 0, a recoverable failure is still recovered (restart and
in place), the console keeps every line, and each broken file costs one warning."""
from __future__ import annotations

import re

import pytest

from leto_testing import SCRIPTS, base_env, leto_cmd, run

SABOTAGE = str(SCRIPTS / "sabotage_logs.py")
EV_WARNING = "cannot write the event log /dev/full"


def restart_job(*args):
    return leto_cmd("--no-status", "--recovery", "restart", "--nproc-per-node", "2",
                    "--max-restarts", "1", *args)


def warnings(err: str, text: str) -> int:
    return sum(text in line for line in err.splitlines() if "warning" in line)


def launcher_traceback(err: str) -> bool:
    """A traceback of leto-run itself (workers' lines carry their `[r...]` label)."""
    return any("Traceback" in line for line in err.splitlines() if not line.startswith("[r"))


def test_event_log_on_a_full_disk_job_exits_0(tmp_path, out_dir):
    r = run(leto_cmd("--no-status", "--recovery", "restart", "--nproc-per-node", "2",
                     "--events", "/dev/full", str(SCRIPTS / "hello.py")), base_env(out_dir),
            timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not launcher_traceback(r.stderr), r.stderr[-4000:]
    assert warnings(r.stderr, EV_WARNING) == 1, r.stderr[-3000:]
    assert (out_dir / "hello_0").exists() and (out_dir / "hello_1").exists()


@pytest.mark.parametrize("stream_opt", ["--tee", "--redirects"])
def test_full_disk_under_events_and_rank_logs_restart_still_recovers(tmp_path, out_dir,
                                                                     stream_opt):
    logs = tmp_path / "logs"
    r = run(restart_job("--events", "/dev/full", "--log-dir", str(logs), stream_opt, "3",
                        SABOTAGE, "full"), base_env(out_dir), timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert not launcher_traceback(r.stderr), r.stderr[-4000:]
    assert (out_dir / "sabotaged").exists()
    assert (out_dir / "done_0").exists() and (out_dir / "done_1").exists()
    # Attempt 1's files are /dev/full: its lines reach the console (redirected ones too).
    for rank in (0, 1):
        assert f"out attempt=1 rank={rank}" in r.stdout, r.stdout
        assert f"err attempt=1 rank={rank}" in r.stderr, r.stderr[-3000:]
    assert warnings(r.stderr, EV_WARNING) == 1, r.stderr[-3000:]
    assert warnings(r.stderr, "log file") == 1, r.stderr[-3000:]
    # Attempt 0 wrote its files normally; the report is built from the events in memory.
    out0 = next(logs.glob("*/attempt_0/0/stdout.log")).read_text()
    assert "out attempt=0 rank=0" in out0
    if stream_opt == "--redirects":
        assert "out attempt=0 rank=0" not in r.stdout       # redirected while the file worked
    assert re.search(r"#1 generation 0->1: rank 0 exit code 3", r.stderr), r.stderr[-3000:]


def test_log_root_gone_mid_run_does_not_stop_the_restart(tmp_path, out_dir):
    logs, ev = tmp_path / "logs", tmp_path / "ev.jsonl"
    r = run(restart_job("--events", str(ev), "--log-dir", str(logs), "--tee", "3",
                        SABOTAGE, "root-file"), base_env(out_dir), timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert not launcher_traceback(r.stderr), r.stderr[-4000:]
    assert (out_dir / "done_0").exists() and (out_dir / "done_1").exists()
    for rank in (0, 1):
        assert f"out attempt=1 rank={rank}" in r.stdout, r.stdout
    assert warnings(r.stderr, "cannot create log directory") == 1, r.stderr[-3000:]
    [root] = list(logs.iterdir())
    assert root.is_file()              # what the script left: nothing recreated it
    assert '"event": "job_end"' in ev.read_text() and '"exit_code": 0' in ev.read_text()


def test_full_disk_event_log_in_place_recovery_still_recovers(tmp_path, out_dir):
    r = run(leto_cmd("--no-status", "--standalone", "--nproc-per-node", "2", "--demote",
                     "replace", "--events", "/dev/full", "--inject", "kill:rank=1:step=3",
                     str(SCRIPTS / "inplace.py"), "ok", "6", "0.05"), base_env(out_dir),
            timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert not launcher_traceback(r.stderr), r.stderr[-4000:]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 1 last 5"
    assert warnings(r.stderr, EV_WARNING) == 1, r.stderr[-3000:]
    assert "in place: rank 1 Signal 9 (SIGKILL) at step 3" in r.stderr
