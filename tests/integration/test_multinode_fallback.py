"""Checkpoint fallback across two `leto-run --nnodes 2` agents on loopback (c10d rendezvous on
127.0.0.1, one trainer per node, one checkpoint directory the nodes share, as a cluster's
shared file system), against examples/byo_train.py under torchrun with stock torch and no
failure: every loss of every step a rank ran and each rank's final state, bit for bit.

In restart mode (`--recovery restart`), the restarted nodes resume from the same checkpoint.

In place, one run, two fallbacks of the whole job:
1. rank 1 loses 3 pages of a group whose parity tolerates 2: its node cannot recover in place,
   announces its fallback in the round's store and stops; the other node restarts instead of
   taking its trainer's failure for a HOF, and both start the next round from the checkpoint of
   step 3 (leto_run.nodes, start_plan);
2. once the checkpoint of step 6 is written (after that fallback), the agent of the node that
   does not host the rendezvous is SIGKILLed, with everything it started: the other agent hears
   no beat for --peer-timeout, takes the node for lost (not a HOF to recover in place), falls
   back to step 6 and waits in the next round; a replacement agent started with the same
   command joins it, and every node starts from that checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from leto_testing import (ROOT, base_env, compare_runs, events, free_port, job_secret_file,
                          leto_cmd, listening, of, pid_alive, run, shared_dir, torchrun_cmd)

SCRIPT = str(ROOT / "examples" / "byo_train.py")
GEOMETRY = ("--page-bytes", "4096", "--data-pages", "4", "--tier1", "2", "--tier2", "1",
            "--chunk-pages", "2")
STEPS = 12
ENV = {"OMP_NUM_THREADS": "1"}      # one trainer per node: pinned as torchrun's two are


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    def build(ref: Path) -> None:
        p = run(torchrun_cmd("--standalone", "--nproc-per-node", "2", SCRIPT, "--steps",
                             str(STEPS), "--out", str(ref)), base_env(**ENV), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    return shared_dir(tmp_path_factory, "mn_ref", build)


@pytest.mark.timeout(600)
def test_a_lost_node_and_a_node_beyond_tolerance_fall_back_on_every_node_exactly(reference,
                                                                                tmp_path):
    ref = reference
    out, ck = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    port = free_port()
    secret = job_secret_file(tmp_path)

    def agent(n: int, inject: tuple = ("--inject", "pages:rank=1:count=3:tier=device:step=5"),
              ) -> subprocess.Popen:
        cmd = leto_cmd("--no-status", "--nnodes", "2", "--nproc-per-node", "1",
                       "--secret-file", str(secret), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mn-fallback",
                       "--events", str(tmp_path / f"ev{n}.jsonl"), *GEOMETRY,
                       "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
                       "--peer-timeout", "5", *inject, SCRIPT, "--steps", str(STEPS),
                       "--step-time", "1.0", "--out", str(out))
        return subprocess.Popen(cmd, env=base_env(**ENV), cwd=str(ROOT), text=True,
                                stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / f"err{n}", "w"))

    # 1 s steps: the checkpoint of step 3 is complete before the loss at step 5 on a busy
    # machine too (the kill's step is watched, not timed).
    procs = {0: agent(0)}
    end = time.monotonic() + 400
    try:
        while not listening(port):        # agent 0 hosts the rendezvous: it must survive
            assert procs[0].poll() is None and time.monotonic() < end, _err(tmp_path, 0)
            time.sleep(0.1)
        procs[1] = agent(1)
        # After the first fallback (both nodes, to step 3): the checkpoint of step 6.
        while not (_fell_back(tmp_path, 2) and (ck / "step_000000006").is_dir()):
            assert all(pr.poll() is None for pr in procs.values()), _errs(tmp_path, procs)
            assert time.monotonic() < end, "no checkpoint of step 6 after the first fallback"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        procs[2] = agent(2, inject=())     # the replacement node
        for n in (0, 2):
            procs[n].wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        for pr in procs.values():
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    assert [procs[0].returncode, procs[2].returncode] == [0, 0], _errs(tmp_path, procs)
    compare_runs(ref, out, 2, range(STEPS), _errs(tmp_path, procs))

    ev = {n: events(tmp_path / f"ev{n}.jsonl") for n in range(3)}
    # 1: one node decided, the other followed; both from step 3.
    first = sorted((e.get("by", "self"), e["step"]) for n in (0, 1)
                   for e in of(ev[n], "fallback") if "node(s) lost" not in e["reason"])
    assert first == [("peer", 3), ("self", 3)], first
    # 2: the survivor took the silent node for lost, not for a HOF, and fell back to the newest
    # complete checkpoint: step 6, or 9 where that one completed before the kill (the shadow
    # writes at nice 19, so on a busy machine step 6's lands late); the replacement started
    # from the same checkpoint.
    [lost] = [e for e in of(ev[0], "fallback") if "node(s) lost" in e["reason"]]
    assert lost["step"] in (6, 9) and "--peer-timeout 5 s" in lost["reason"], lost
    assert not [e for e in of(ev[0], "promote") if e["generation"] > lost["generation"]]
    [follow] = of(ev[2], "fallback")
    assert follow["by"] == "peer" and follow["step"] == lost["step"], (follow, lost)
    assert [e["path"] for e in of(ev[2], "start_plan")] == [str(ck / f"step_{lost['step']:09d}")]
    assert sorted(x for x in os.listdir(ck) if not x.startswith(".")) == [
        "step_000000009", "step_000000012"]
    # The killed node left nothing running (its trainers die with their agent).
    deadline = time.monotonic() + 30
    while [e["pid"] for e in of(ev[1], "spawn") if pid_alive(e["pid"])]:
        assert time.monotonic() < deadline, "the killed node's processes outlived it"
        time.sleep(0.2)


def test_in_restart_mode_every_node_resumes_from_the_same_checkpoint(reference, tmp_path):
    """`--recovery restart` on two nodes: rank 1 is SIGKILLed at step 7; both agents restart,
    agree on the newest complete checkpoint and redo the steps after it bit-exactly (torchrun +
    DCP's recovery, without the script's own resume code)."""
    out, ck, port = tmp_path / "out", tmp_path / "ck", free_port()
    out.mkdir()
    procs = [subprocess.Popen(leto_cmd(
        "--no-status", "--nnodes", "2", "--nproc-per-node", "1", "--recovery", "restart",
        "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "mn-restart", "--events", str(tmp_path / f"ev{n}.jsonl"),
        "--checkpoint-dir", str(ck), "--checkpoint-every", "3", "--inject", "kill:rank=1:step=7",
        SCRIPT, "--steps", str(STEPS), "--step-time", "0.5", "--out", str(out)),
        env=base_env(**ENV), cwd=str(ROOT), stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"err{n}", "w")) for n in range(2)]
    try:
        for pr in procs:
            pr.wait(timeout=240)
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    assert [pr.returncode for pr in procs] == [0, 0], _errs(tmp_path, dict(enumerate(procs)))
    compare_runs(reference, out, 2, range(STEPS), _errs(tmp_path, dict(enumerate(procs))))
    # Both nodes start the restart from one checkpoint: the newest complete one when the plan was
    # made.  Which one that is depends on how far the writes had come (on a busy machine even
    # step 3's may still be in flight), so the expectation is read from the writes' own events:
    # the plan names a checkpoint that was written whole, and none newer had been before it.
    evs = [events(tmp_path / f"ev{n}.jsonl") for n in range(2)]
    plans = [[(e["path"], e["mono"]) for e in of(ev, "start_plan")] for ev in evs]
    paths = [[p for p, _ in pl] for pl in plans]
    assert paths[0] == paths[1] and len(paths[0]) == 2 and paths[0][0] is None, plans
    made = min(m for _, m in (plans[0][1], plans[1][1]))
    written = {e["path"]: e["mono"] for ev in evs for e in of(ev, "phase", phase="checkpoint")
               if e.get("path")}
    chosen = paths[0][1]
    before = [p for p, m in written.items() if m < made]
    assert chosen is None or chosen in written, (chosen, written)
    assert all(chosen is not None and p <= chosen for p in before), (chosen, before, made)
    assert chosen is None or chosen in (str(ck / "step_000000003"), str(ck / "step_000000006"))


def _fell_back(tmp_path: Path, n: int) -> bool:
    return sum(len(of(events(tmp_path / f"ev{i}.jsonl"), "fallback")) for i in range(n)
               if (tmp_path / f"ev{i}.jsonl").exists()) >= 2


def _err(tmp_path: Path, n: int) -> str:
    f = tmp_path / f"err{n}"
    return f"agent {n}:\n" + (f.read_text()[-3000:] if f.exists() else "")


def _errs(tmp_path: Path, procs) -> str:
    return "\n".join(_err(tmp_path, n) for n in sorted(procs))
