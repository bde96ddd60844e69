"""A signal stops leto-run while it waits in a rendezvous (red-team 7).

torch's rendezvous blocks in C++ (c10d: until join_timeout; static: the store waits up to 600 s
for the other nodes), where the agent's signal wakeup fd went unread: SIGTERM at 4 s ended the
job 32 s later with "rendezvous failed" (c10d), or 600 s later (static).  Expected as at any
other time (torchrun's codes too): 128+N within 2 s, nothing left behind.  A 2-node job with
only one agent started never completes its round; real signals, real processes."""
import os
import signal
import subprocess
import time

import pytest

from leto_testing import ROOT, base_env, events, free_port, leto_cmd, of, with_env

HELLO = "import os\nprint('hello rank', os.environ.get('RANK'), flush=True)\n"


def _start(out_dir, tmp_path, *args):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    tmp = tmp_path / "t"
    tmp.mkdir()
    ev = tmp_path / "ev.jsonl"
    p = subprocess.Popen(leto_cmd("--no-status", "--nnodes", "2", "--recovery", "restart",
                                  "--events", str(ev), *args, str(script)),
                         env=base_env(out_dir, TMPDIR=str(tmp)), cwd=str(ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p, ev, tmp


def _wait_event(p, ev, name, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ev.exists() and of(events(ev), name):
            return
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.05)
    raise TimeoutError(f"no {name} event")


def _stop_and_check(p, ev, tmp, out_dir, sig):
    t0 = time.monotonic()
    p.send_signal(sig)
    try:
        out, _ = p.communicate(timeout=30)
    finally:
        p.kill()
    took = time.monotonic() - t0
    assert p.returncode == 128 + sig, (p.returncode, out[-3000:])
    assert took < 2.0, (took, out[-3000:])
    end = of(events(ev), "job_end")
    assert end and end[-1]["exit_code"] == 128 + sig
    assert "rendezvous" not in end[-1].get("reason", "")
    assert [e.name for e in os.scandir(tmp) if e.name.startswith("leto-")] == []
    time.sleep(0.3)
    assert with_env(f"OUT_DIR={out_dir}") == []       # guardian, fork server: all gone


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_signal_during_first_rendezvous(out_dir, tmp_path, backend, sig):
    port = str(free_port())
    rdzv = (("--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id",
             "x", "--rdzv-conf", "join_timeout=30") if backend == "c10d"
            else ("--master-port", port))
    p, ev, tmp = _start(out_dir, tmp_path, *rdzv)
    _wait_event(p, ev, "job_start", 60)
    time.sleep(2.0)                     # well inside the round that never completes
    _stop_and_check(p, ev, tmp, out_dir, sig)


WAIT_OR_FAIL = ("import os, sys, time\n"
                "trigger = os.environ.get('FAIL_ON')\n"
                "while not (trigger and os.path.exists(trigger)):\n"
                "    time.sleep(0.05)\n"
                "sys.exit(int(os.environ['EXIT_CODE']))\n")


@pytest.mark.parametrize("where", ["restart_round", "exit_barrier"])
def test_signal_while_waiting_for_a_stopped_peer(out_dir, tmp_path, where):
    """The rendezvous of a restart takes the same path: agent A's worker fails, A restarts and
    waits in round 2 for agent B, which is stopped (SIGSTOP); SIGTERM ends A at once.  So does
    the exit barrier (torch's store barrier, up to --exit-barrier-timeout): A's worker
    succeeded, A waits there for B."""
    script = tmp_path / "wait_or_fail.py"
    script.write_text(WAIT_OR_FAIL)
    code = "1" if where == "restart_round" else "0"
    port, trigger = free_port(), tmp_path / "fail"
    procs, evs = [], []
    for name in ("a", "b"):
        d = tmp_path / name
        (d / "t").mkdir(parents=True)
        (d / "out").mkdir()
        ev = d / "ev.jsonl"
        env = base_env(d / "out", TMPDIR=str(d / "t"), EXIT_CODE=code,
                       **({"FAIL_ON": str(trigger)} if name == "a" else {}))
        procs.append(subprocess.Popen(
            leto_cmd("--no-status", "--nnodes", "2", "--recovery", "restart", "--max-restarts",
                     "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                     "--rdzv-id", "r", "--rdzv-conf", "join_timeout=60", "--events", str(ev),
                     str(script)),
            env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        evs.append(ev)
        if name == "a":       # A hosts the rendezvous store: B, stopped, holds none of it
            _wait_event(procs[0], ev, "job_start", 90)
    a, b = procs
    try:
        for p, ev in zip(procs, evs):
            _wait_event(p, ev, "rendezvous", 90)
        time.sleep(1.0)                 # the workers started
        b.send_signal(signal.SIGSTOP)
        trigger.touch()
        _wait_event(a, evs[0], "restart" if code == "1" else "decision", 30)
        time.sleep(1.5)                 # A is now waiting in round 2 (the barrier) for B
        assert len(of(events(evs[0]), "rendezvous")) == 1
        assert not of(events(evs[0]), "exit_barrier")
        _stop_and_check(a, evs[0], tmp_path / "a" / "t", tmp_path / "a" / "out", signal.SIGTERM)
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=30)
