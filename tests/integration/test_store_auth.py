"""Another local user cannot train into a job (issue 16, item 3).

A leto-run job of examples/gpt_inplace.py (the README's script) runs on CPU with its shadows
waiting; a process of another uid (65534) connects to the job's worker store, which it finds
listening on loopback, and sets the go keys of the next generation, as the agent would, without
the job's key.  The shadows must not train: no `promoted` event, every loss the job logged is
the fault-free one (a torchrun run of the same script is the reference), and the agent stops the
job with its typed error (exit 5) naming the forged key.  Before that, every TCP listener of the
agent is a loopback one (a single-node job)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leto_run.store_listen import listening_addresses
from leto_testing import ROOT, base_env, events, leto_cmd, run, step_losses, torchrun_cmd

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
STEPS = 60            # long enough for the shadows to reach their wait, even on a loaded machine
EXIT_CONTROL_FORGED = 5
ATTACK = """
import datetime, json, os, sys
import torch.distributed as dist
os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
addr, port, gen, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
s = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=30))
for r in ranks.split(","):
    s.set(f"leto/go/{gen}/{r}", json.dumps({"mono": 0.0}))
print("uid", os.getuid(), flush=True)
"""


def _wait_events(path: Path, proc, pred, what: str, timeout: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = events(path) if path.exists() else []
        if pred(evs):
            return evs
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    out, err = proc.communicate(timeout=60) if proc.poll() is None else proc.communicate()
    pytest.fail(f"no {what} (exit {proc.returncode}):\n{err[-3000:]}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_another_uid_cannot_promote_a_shadow(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", "2", SCRIPT, "--steps", str(STEPS),
                         "--out", str(ref)), base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out, ev = tmp_path / "out", tmp_path / "events.jsonl"
    out.mkdir()
    proc = subprocess.Popen(leto_cmd("--no-status", "--nproc-per-node", "2", "--events", str(ev),
                                     "--log-dir", str(tmp_path / "logs"), SCRIPT, "--steps",
                                     str(STEPS), "--step-time", "1.0", "--out", str(out)),
                            env=base_env(), cwd=str(ROOT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        evs = _wait_events(ev, proc, lambda es: sum(
            e["event"] == "spawn" and e["role"] == "shadow" and e["generation"] == 1
            for e in es) == 2, "shadows of generation 1")
        rdzv = next(e for e in evs if e["event"] == "rendezvous")
        listeners = listening_addresses(proc.pid)
        assert rdzv["master_port"] in {port for _, port in listeners}
        assert all(ip in ("127.0.0.1", "::1") for ip, _ in listeners), listeners
        attack = subprocess.run([sys.executable, "-c", ATTACK, rdzv["master_addr"],
                                 str(rdzv["master_port"]), "1", "0,1"],
                                capture_output=True, text=True, timeout=120)
        assert attack.stdout.split() == ["uid", "65534"], attack.stderr[-2000:]
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    evs = events(ev)
    assert not [e for e in evs if e["event"] == "promoted"], "a forged go key promoted a shadow"
    assert proc.returncode == EXIT_CONTROL_FORGED, err[-3000:]
    assert "leto/go/1/" in err and "did not verify" in err, err[-3000:]
    end = next(e for e in evs if e["event"] == "job_end")
    assert end["exit_code"] == EXIT_CONTROL_FORGED and "leto/go/1/" in end["reason"]
    for rank in (0, 1):
        want, got = step_losses(ref, rank), step_losses(out, rank)
        assert got, f"rank {rank} logged no step"
        for step, values in got.items():
            assert values == want[step], f"rank {rank} step {step}: {values} != {want[step]}"
