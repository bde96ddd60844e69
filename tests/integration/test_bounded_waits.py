"""Every wait of the agent on a process is bounded by --hang-timeout, and the hang is blamed on
the process that owes the sign of life (real processes, real SIGSTOP / SIGKILL, gloo on CPU).

- A promoted shadow that never confirms its promotion (it was SIGSTOPped while it waited) is a
  hang of its own rank, judged --hang-timeout after the promotion: not a gloo timeout of its
  peer --pg-timeout later, blamed on the peer.
- A state manager that is stopped for --hang-timeout is judged hung and restarted from the
  fds the agent kept; the trainers of its slot go on (examples/gpt_inplace.py, the runtime's
  own client calls).
- An agent that was itself stopped for longer than --hang-timeout judges nobody on the stale
  times it holds: it reads what queued first, and gives every process a fresh window.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from leto_testing import (ROOT, SCRIPTS, assert_nothing_left, base_env, event_waiter, events,
                          inplace_cmd, of)

HANG_S = 4.0          # --hang-timeout: wide enough for a beat every 0.05 s step on busy cores


def _start(cmd, out_dir) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=base_env(out_dir), cwd=str(ROOT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _stop_then_kill(p: subprocess.Popen, stopped: int, victim: int, pause: float,
                    timeout: float) -> tuple[str, float]:
    """SIGSTOP `stopped`, `pause` s later SIGKILL `victim`; (the launcher's stderr once it
    ended, when the stop was sent)."""
    os.kill(stopped, signal.SIGSTOP)
    t_stop = time.monotonic()
    time.sleep(pause)
    os.kill(victim, signal.SIGKILL)
    return p.communicate(timeout=timeout)[1], t_stop


def test_a_promoted_shadow_that_never_confirms_is_a_hang_of_its_own_rank(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    p = _start(inplace_cmd(ev, "--hang-timeout", str(HANG_S), str(SCRIPTS / "inplace.py"), "ok",
                           "200", "0.05"), out_dir)
    try:
        wait_for = event_waiter(p, ev, time.monotonic() + 90)
        wait_for(lambda evs: len(of(evs, "shadow_ready", generation=1)) == 2, "both shadows ready")
        [shadow] = of(events(ev), "spawn", role="shadow", generation=1, rank=1)
        [active] = of(events(ev), "spawn", role="active", generation=0, rank=1)
        # the shadow will never see its go key
        err, _ = _stop_then_kill(p, shadow["pid"], active["pid"], 0.5, 120)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, err[-4000:]
    evs = events(ev)
    [promote] = of(evs, "promote", generation=1, rank=1)
    assert promote["pid"] == shadow["pid"]
    # The first failure of generation 1 is the stopped process, judged a hang of rank 1 ...
    fails = of(evs, "failure_detected", generation=1)
    assert fails and fails[0]["rank"] == 1 and fails[0]["pid"] == shadow["pid"], fails
    assert "hang" in fails[0]["how"], fails[0]
    assert not [f for f in fails if f["rank"] == 0], fails      # the waiting peer is collateral
    [hang] = of(evs, "hang_detected", generation=1)
    assert hang["pid"] == shadow["pid"] and "promot" in hang["reason"], hang
    # ... within the hang timeout of its promotion (plus a loaded machine's turn), long before
    # a gloo timeout (30 s in inplace.py) of its peer
    assert HANG_S <= hang["mono"] - promote["mono"] < HANG_S + 10, (promote, hang)
    assert of(evs, "stack_dump", pid=shadow["pid"])
    # generation 2's shadows took over and finished the job
    assert sorted(e["rank"] for e in of(evs, "promote", generation=2)) == [0, 1]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 2 last 199"
    assert_nothing_left(evs)


def _loss_step(out, rank: int) -> int:
    """The last step examples/gpt_inplace.py logged for `rank` (-1: none yet)."""
    try:
        lines = (out / f"loss_{rank}.jsonl").read_text().strip().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else -1
    except (OSError, ValueError, KeyError):
        return -1


def test_a_stopped_state_manager_is_judged_hung_and_restarted(tmp_path, out_dir):
    """Rank 1's state manager is SIGSTOPped, then rank 1's active killed: the promoted trainer
    of rank 1 (and the next shadow of slot 1) block on the stopped state manager.  The agent
    judges the state manager hung --hang-timeout after it saw it stopped, kills it (its own
    slot named) and restarts it from the fds it kept; the job completes, every failure blamed
    on rank 1, none left waiting for --pg-timeout."""
    from fault_matrix import GEOMETRY        # small pages: the model spans several groups
    geometry = [a for k, v in GEOMETRY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    ev, steps = tmp_path / "ev.jsonl", 200
    p = _start(inplace_cmd(ev, "--hang-timeout", str(HANG_S), *geometry,
                           str(ROOT / "examples" / "gpt_inplace.py"), "--steps", str(steps),
                           "--out", str(out_dir), "--step-time", "0.02"), out_dir)
    t_stop = 0.0
    try:
        wait_for = event_waiter(p, ev, time.monotonic() + 120)
        wait_for(lambda evs: len(of(evs, "shadow_ready", generation=1)) == 2, "both shadows ready")
        wait_for(lambda evs: _loss_step(out_dir, 1) >= 5, "rank 1 at step 5")
        [sm] = of(events(ev), "spawn", role="state_manager", local_rank=1)
        [active] = of(events(ev), "spawn", role="active", generation=0, rank=1)
        err, t_stop = _stop_then_kill(p, sm["pid"], active["pid"], 0.3, 150)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, err[-4000:]
    evs = events(ev)
    [hung] = of(evs, "hang_detected", role="state_manager")
    assert hung["pid"] == sm["pid"] and hung["local_rank"] == 1 and "stopped" in hung["reason"]
    # the agent's clock for it starts at the loop turn that saw it stopped (up to a turn early)
    assert HANG_S - 1.0 <= hung["mono"] - t_stop < HANG_S + 10, hung
    [restart] = of(evs, "sm_restart")
    assert restart["old_pid"] == sm["pid"] and restart["local_rank"] == 1
    fails = of(evs, "failure_detected")
    assert fails and {f["rank"] for f in fails} == {1}, fails
    # the last recovery began within a few hang timeouts, not after --pg-timeout (600 s)
    last = max(e["mono"] for e in of(evs, "promote"))
    assert last - t_stop < 4 * HANG_S + 15, (t_stop, last)
    assert _loss_step(out_dir, 0) == _loss_step(out_dir, 1) == steps - 1
    assert_nothing_left(evs)


@pytest.mark.parametrize("steps", [60, 400], ids=["trainers-exit-during-the-pause",
                                                   "trainers-run-on-after-it"])
def test_a_paused_agent_judges_no_healthy_trainer_hung(tmp_path, out_dir, steps):
    """The agent itself is SIGSTOPped for 4 hang timeouts while its trainers run on (they
    finish meanwhile, or train on after it): on SIGCONT it reads what queued (exits,
    datagrams) before any verdict, sees that its own loop was away, and gives every process a
    fresh window instead of judging stale times: no hang, no failure, no recovery."""
    ev, hang_s = tmp_path / "ev.jsonl", 3.0
    p = _start(inplace_cmd(ev, "--hang-timeout", str(hang_s), str(SCRIPTS / "inplace.py"), "ok",
                           str(steps), "0.05"), out_dir)
    try:
        wait_for = event_waiter(p, ev, time.monotonic() + 90)
        wait_for(lambda evs: len(of(evs, "shadow_ready", generation=1)) == 2, "both shadows ready")
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(3 * hang_s + 3)
        os.kill(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, err[-4000:]
    evs = events(ev)
    assert not of(evs, "hang_detected") and not of(evs, "failure_detected"), err[-3000:]
    assert not of(evs, "promote")
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == f"gen 0 last {steps - 1}"
    if steps > 60:       # processes still running when it came back got a fresh window
        stalls = of(evs, "agent_stalled")
        assert [s for s in stalls if s["seconds"] >= 3 * hang_s and s["processes"] >= 2
                and "grace" in s["reason"]], stalls
    assert_nothing_left(evs)


def test_paused_tells_a_stopped_process_from_a_running_one():
    """leto_run.procs.paused, what the agent reads of a state manager each turn (and of a hung
    trainer, whose stacks a stopped process cannot dump)."""
    import sys
    from leto_run.procs import paused
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not paused(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        end = time.monotonic() + 10
        while not paused(p.pid) and time.monotonic() < end:
            time.sleep(0.01)
        assert paused(p.pid)
        os.kill(p.pid, signal.SIGCONT)
        end = time.monotonic() + 10
        while paused(p.pid) and time.monotonic() < end:
            time.sleep(0.01)
        assert not paused(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not paused(p.pid)                  # gone: not stopped
