"""A console that goes away does not end the job (red-team 6).

`leto-run ... 2>&1 >out | head -1`: the reader of the agent's stderr exits after one line, so
every later console write is EPIPE.  torchrun logs through `logging`, which swallows the error,
and its job goes on; so must ours: exit 0, every step run, `job_end` and one `console_lost`
in the event log, the recovery report's data still in the event log and the log files.
Real processes, a real pipe closed by its reader."""
import subprocess
import sys
import time

import pytest

from leto_testing import ROOT, base_env, events, leto_cmd, of, with_env

STEPS = 14


def _job(ev, log_dir, out_dir):
    return leto_cmd("--standalone", "--nproc-per-node", "1", "--tee", "3",
                    "--log-dir", str(log_dir), "--events", str(ev),
                    str(ROOT / "examples" / "gpt_inplace.py"), "--model", "tiny",
                    "--steps", str(STEPS), "--print-every", "1", "--step-time", "0.3",
                    "--out", str(out_dir))


@pytest.mark.parametrize("shared", [False, True], ids=["stderr_pipe", "stdout_and_stderr_pipe"])
def test_closed_console_does_not_end_the_job(out_dir, tmp_path, shared):
    ev, log_dir = tmp_path / "ev.jsonl", tmp_path / "logs"
    out_file = open(tmp_path / "stdout.txt", "wb")
    p = subprocess.Popen(_job(ev, log_dir, out_dir), env=base_env(out_dir), cwd=str(ROOT),
                         stdout=subprocess.PIPE if shared else out_file,
                         stderr=subprocess.STDOUT if shared else subprocess.PIPE)
    try:
        reader = p.stdout if shared else p.stderr
        first = reader.readline()           # `head -1`: one line, then the reader is gone
        reader.close()
        assert first, "leto-run wrote nothing"
        rc = p.wait(timeout=180)
    finally:
        p.kill()
        out_file.close()
    evs = events(ev)
    end = of(evs, "job_end")
    assert rc == 0, (rc, [e["event"] for e in evs][-10:])
    assert end and end[-1]["exit_code"] == 0
    lost = of(evs, "console_lost")
    assert len(lost) == 1 and "Broken pipe" in lost[0]["reason"], lost
    # Every step ran: its loss record, and the trainer's own log file (`--tee`).
    assert len((out_dir / "loss_0.jsonl").read_text().splitlines()) == STEPS
    logs = "".join(f.read_text() for f in log_dir.rglob("stdout.log"))
    assert f"step {STEPS - 1:4d}" in logs, logs[-2000:]
    time.sleep(0.5)
    assert with_env(f"OUT_DIR={out_dir}") == []


CONSOLE_PROBE = """
import os, sys
r, w = os.pipe()
os.dup2(w, 2)
os.close(w)
os.close(r)                          # the reader is gone: every write to fd 2 is EPIPE
from leto_run.console import CONSOLE
from leto_run.events import console_warning
first = CONSOLE.write("one\\n")
console_warning("two")               # the event log's and the log files' warning sink
sys.stderr.write("a library's line\\n")
sys.stderr.flush()                    # /dev/null now: nothing raises
lost = []
CONSOLE.report(lambda *a, **k: lost.append(k), 0)
CONSOLE.report(lambda *a, **k: lost.append(k), 0)
print(first, CONSOLE.write("three\\n"), len(lost), lost[0]["reason"])
"""


def test_console_writer_on_a_closed_pipe(out_dir):
    """The writer itself, in a real process whose fd 2 is a pipe without a reader: the first
    write loses the console, nothing raises later (its own writes, the warning helper, a
    library writing to sys.stderr, the interpreter's last flush), one `console_lost`."""
    r = subprocess.run([sys.executable, "-c", CONSOLE_PROBE], env=base_env(out_dir),
                       cwd=str(ROOT), stdout=subprocess.PIPE, timeout=60, text=True)
    assert r.returncode == 0, r.stdout
    assert r.stdout.split()[:3] == ["False", "False", "1"], r.stdout
    assert "BrokenPipeError" in r.stdout
