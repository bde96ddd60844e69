"""The event log and the log pump degrade on real write failures (issue 16, item 7).

Write failures are real: RLIMIT_FSIZE makes the kernel refuse every byte past a size (EFBIG,
a short write first when a write crosses the limit), for root and for everyone else; `/dev/full`
refuses every byte (ENOSPC).  Each scenario runs in a fresh interpreter, so the limit never
touches the test process.  The expectations are independent: the file must be a clean prefix
of what was emitted (every line parses, in order), memory keeps everything, one warning."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 700          # bytes: a few event lines fit, then one crosses the limit


def run_py(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "TMP_PATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"})


def test_event_log_past_a_file_size_limit_keeps_a_clean_prefix(tmp_path):
    r = run_py(f"""
        import json, os, resource, signal
        from leto_run.events import EventLog     # imported before the limit: no cache write
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT}))
        log = EventLog(os.path.join(os.environ["TMP_PATH"], "ev.jsonl"), "node0")
        for i in range(40):
            log.emit("spawn", 0, rank=i, pid=1000 + i, note="x" * 30)
        log.close()
        print(json.dumps({{"records": [r["event"] for r in log.records], "written": log.written,
                          "unwritten": log.unwritten, "error": log.write_error}}))
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    lines = (tmp_path / "ev.jsonl").read_text().splitlines()
    assert 0 < len(lines) < 40 and (tmp_path / "ev.jsonl").stat().st_size <= LIMIT
    assert [json.loads(x)["rank"] for x in lines] == list(range(len(lines)))   # clean prefix
    assert got["written"] == len(lines) and got["unwritten"] == 40 - len(lines)
    assert got["records"] == ["spawn"] * (len(lines) + 1) + ["event_log_degraded"] + \
        ["spawn"] * (40 - len(lines) - 1)
    assert "File too large" in got["error"]
    assert r.stderr.count("warning: cannot write the event log") == 1, r.stderr


def test_event_log_that_cannot_be_opened_keeps_everything_in_memory(tmp_path):
    (tmp_path / "f").write_text("a file")
    r = run_py("""
        import os
        from leto_run.events import EventLog
        log = EventLog(os.path.join(os.environ["TMP_PATH"], "f", "ev.jsonl"), "node0")
        log.emit("job_start", 0)
        log.emit("job_end", 0, exit_code=0)
        print([r["event"] for r in log.records], log.unwritten)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['event_log_degraded', 'job_start', 'job_end'] 2"
    assert r.stderr.count("warning: cannot open the event log") == 1, r.stderr


def test_event_records_are_bounded_in_memory(tmp_path):
    r = run_py("""
        from leto_run import events as E
        log = E.EventLog(None, "node0")
        for i in range(E.MAX_RECORDS + 5):
            log.emit("beat", 0, i=i)
        print(len(log.records), log.records_dropped, log.records[-1]["i"], log.records[0]["i"])
    """, tmp_path)
    n, dropped, last, first = map(int, r.stdout.split())
    from leto_run.events import MAX_RECORDS
    assert n <= MAX_RECORDS and n + dropped == MAX_RECORDS + 5
    assert last == MAX_RECORDS + 4 and first == dropped           # the oldest went first


def test_pump_keeps_the_console_when_its_file_fails(tmp_path):
    """A redirected stream whose file stops taking bytes goes on to the console, and a teed
    one keeps its console; the files hold what was written before the limit."""
    r = run_py(f"""
        import os, resource, signal, sys, threading
        from leto_run.logs import OutputPump, StreamPlan     # before the limit: no cache write
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT}))
        tmp = os.environ["TMP_PATH"]
        pump = OutputPump(threading.Lock())
        fds = []
        for name, console in (("red", False), ("tee", True)):
            r, w = os.pipe()
            pump.add(r, StreamPlan(os.path.join(tmp, name + ".log"), console), f"[{{name}}] ",
                     "stdout")
            fds.append(w)
        for i in range(60):
            for w in fds:
                os.write(w, f"line {{i:02d}} {{'y' * 20}}\\n".encode())
        for w in fds:
            os.close(w)
        assert pump.wait_drained(30)
        pump.close()
        print("errors", pump.file_errors, file=sys.stderr)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    tee = [x for x in out if x.startswith("[tee] ")]
    assert tee == [f"[tee] line {i:02d} {'y' * 20}" for i in range(60)]   # every line
    red_file = (tmp_path / "red.log").read_text()
    red_console = [x for x in out if x.startswith("[red] ")]
    assert red_file and len(red_file) <= LIMIT
    # what the file did not take reaches the console: the last line of each stream is there
    assert red_console and red_console[-1] == f"[red] line 59 {'y' * 20}"
    assert f"line 59" not in red_file
    assert r.stderr.count("warning: cannot write log file") == 1, r.stderr
    assert "errors 2" in r.stderr


def test_relabel_changes_the_console_label_not_the_files(tmp_path):
    """A promoted shadow's console lines say what it is now; its lines in the rank's shared
    log file keep the label it started with (which tells the file's writers apart)."""
    r = run_py("""
        import os, threading, time
        from leto_run.logs import OutputPump, StreamPlan
        path = os.path.join(os.environ["TMP_PATH"], "stdout.log")
        pump = OutputPump(threading.Lock())
        rd, wr = os.pipe()
        fd = pump.add(rd, StreamPlan(path, True), "[r1 shadow g1]: ", "stdout", prefix_file=True)
        os.write(wr, b"before\\n")
        end = time.monotonic() + 30
        while "before" not in open(path).read() and time.monotonic() < end:
            time.sleep(0.01)
        pump.relabel(fd, "[r1 active g1]: ")
        os.write(wr, b"after\\n")
        os.close(wr)
        assert pump.wait_drained(30)
        pump.relabel(fd, "[r1 gone]: ")          # after EOF: nothing to relabel
        pump.close()
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[r1 shadow g1]: before", "[r1 active g1]: after"]
    assert (tmp_path / "stdout.log").read_text().splitlines() == \
        ["[r1 shadow g1]: before", "[r1 shadow g1]: after"]
