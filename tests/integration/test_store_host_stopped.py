"""A stopped store host is a lost node within --peer-timeout, not after the store's own timeout.

Two `leto-run --nnodes 2` agents on loopback (c10d rendezvous on 127.0.0.1, one trainer per
node, in place).  The agent hosting the rendezvous store is SIGSTOPped (a real signal; its
trainer trains on): every store call of the other agent now waits, up to the store's 60 s
timeout.  The other agent must take the silent node for lost after --peer-timeout (5 s), not
after that timeout -- no store call may stall its loop or count as silence only once it
returns -- and, with no checkpoint to fall back to, end with exit 4 and the reason, its
processes gone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from leto_testing import (ROOT, base_env, events, free_port, job_secret_file, leto_cmd, listening,
                          of, pid_alive)

SCRIPT = str(ROOT / "examples" / "byo_train.py")
GEOMETRY = ("--page-bytes", "4096", "--data-pages", "4", "--tier1", "2", "--tier2", "1",
            "--chunk-pages", "2")
PEER_TIMEOUT = 5.0
# The c10d store's own timeout is 60 s: a verdict that waited for a store call to fail comes
# after it.  Well below, well above --peer-timeout (a busy machine delays the agents' turns).
BOUND_S = 35.0


def _steps(out: Path, rank: int) -> int:
    try:
        return len((out / f"loss_{rank}.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _err(tmp_path: Path, n: int) -> str:
    p = tmp_path / f"err{n}"
    return p.read_text()[-3000:] if p.exists() else ""


@pytest.mark.timeout(400)
def test_a_stopped_store_host_is_a_lost_node_within_the_peer_timeout(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    secret = job_secret_file(tmp_path)

    def agent(n: int) -> subprocess.Popen:
        cmd = leto_cmd("--no-status", "--nnodes", "2", "--nproc-per-node", "1",
                       "--secret-file", str(secret), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                       "--rdzv-id", "store-stopped", "--events", str(tmp_path / f"ev{n}.jsonl"),
                       *GEOMETRY, "--peer-timeout", str(PEER_TIMEOUT), SCRIPT, "--steps",
                       "400", "--step-time", "0.5", "--out", str(out))
        return subprocess.Popen(cmd, env=base_env(OMP_NUM_THREADS="1"), cwd=str(ROOT),
                                text=True, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / f"err{n}", "w"))

    procs = {0: agent(0)}
    end = time.monotonic() + 300
    try:
        while not listening(port):             # agent 0 hosts the store
            assert procs[0].poll() is None and time.monotonic() < end, _err(tmp_path, 0)
            time.sleep(0.1)
        procs[1] = agent(1)
        while not (_steps(out, 0) >= 3 and _steps(out, 1) >= 3):
            assert all(p.poll() is None for p in procs.values()), (_err(tmp_path, 0),
                                                                  _err(tmp_path, 1))
            assert time.monotonic() < end, "the two nodes never trained"
            time.sleep(0.2)
        t_stop = time.monotonic()
        os.kill(procs[0].pid, signal.SIGSTOP)        # the agent alone: its trainer trains on
        code = procs[1].wait(timeout=120)
        took = time.monotonic() - t_stop
    finally:
        for n, p in procs.items():
            if p.poll() is None:
                p.kill()
            p.wait()
    assert code == 4, (code, _err(tmp_path, 1))
    assert took < BOUND_S, f"the lost store host was decided {took:.1f} s after its stop"
    [d] = [e for e in of(events(tmp_path / "ev1.jsonl"), "decision")
           if e["action"] == "unrecoverable"]
    assert f"--peer-timeout {PEER_TIMEOUT:g} s" in d["reason"] and (
        "node(s) lost: localhost (group rank 0" in d["reason"]
        or "the job's store has not answered" in d["reason"]), json.dumps(d)
    # Neither node left anything running (node 0's agent was SIGKILLed while stopped: its
    # guardian ends what it started).
    deadline = time.monotonic() + 30
    for n in (0, 1):
        while [e["pid"] for e in of(events(tmp_path / f"ev{n}.jsonl"), "spawn")
               if pid_alive(e["pid"])]:
            assert time.monotonic() < deadline, f"node {n}'s processes outlived its agent"
            time.sleep(0.2)
