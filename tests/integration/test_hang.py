"""A rank that stops heartbeating inside a step is detected after --hang-timeout, its Python
stacks are dumped into its log, it is killed, and the job fails with it as the root cause."""
import time

import pytest

from leto_testing import SCRIPTS, base_env, events, leto_cmd, run


def test_hang_detected_with_stack_dump(tmp_path, out_dir):
    logs, ev = tmp_path / "logs", tmp_path / "ev.jsonl"
    t0 = time.monotonic()
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "--hang-timeout", "2",
                     "--log-dir", str(logs), "--redirects", "2", "--events", str(ev),
                     str(SCRIPTS / "hang.py"), "3"), base_env(out_dir), timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr[-3000:]
    assert took < 60
    evs = events(ev)
    hangs = [e for e in evs if e["event"] == "hang_detected"]
    assert {e["rank"] for e in hangs} == {0, 1} or len(hangs) >= 1
    first = hangs[0]
    assert first["step"] == 3
    # Detection happened no earlier than the timeout after the last beat.
    beats_done = [e for e in evs if e["event"] == "spawn" and e["role"] == "active"
                  and e["rank"] == first["rank"]][0]
    assert first["mono"] - beats_done["mono"] >= 2.0
    stderr_logs = list(logs.glob("*/attempt_0/*/stderr.log"))
    dumped = [p for p in stderr_logs if "stuck_in_step" in p.read_text()]
    assert dumped, [p.read_text()[-500:] for p in stderr_logs]
    assert "Root Cause" in r.stderr and "hang" in r.stderr


def test_no_false_hang_without_heartbeats(out_dir):
    """Scripts that never call heartbeat() are never judged hung (torchrun behaviour)."""
    r = run(leto_cmd("--no-status", "--hang-timeout", "0.5", str(SCRIPTS / "fail_until.py"), "0"),
            base_env(out_dir))
    assert r.returncode == 0, r.stderr[-2000:]


def test_injected_hang_by_time_is_detected(tmp_path, out_dir):
    """`hang:rank=1:after=3s`: the agent makes the runtime block the training loop (a real hang);
    detection, stack dump and root cause follow as for any hang.  The trainer must have sent a
    heartbeat by then (else the agent can only SIGSTOP it, and a process that never beat is
    never judged hung): hang.py beats before anything else, ~0.2 s after its start, and the 3 s
    leave that a wide margin on a busy machine."""
    from leto_runtime.wire.contract import HANG_SIGNAL

    logs, ev = tmp_path / "logs", tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "--hang-timeout", "1.5",
                     "--log-dir", str(logs), "-r", "2", "--events", str(ev),
                     "--inject", "hang:rank=1:after=3s", str(SCRIPTS / "hang.py"), "100000"),
            base_env(out_dir), timeout=90)
    assert r.returncode == 1, r.stderr[-3000:]
    evs = events(ev)
    inj = [e for e in evs if e["event"] == "inject"][0]
    assert inj["signal"] == HANG_SIGNAL, \
        f"rank 1 had sent no heartbeat {inj['after_s']} s after it started: {inj}"
    hang = [e for e in evs if e["event"] == "hang_detected"][0]
    assert hang["rank"] == 1 and inj["rank"] == 1
    # The deadline runs from the last heartbeat, one 50 ms step before the injection.
    assert 1.4 <= hang["mono"] - inj["mono"] < 5
    err = next(logs.glob("*/attempt_0/1/stderr.log")).read_text()
    assert "injected hang" in err and "block_forever" in err


def test_a_hang_injected_before_any_heartbeat_is_still_detected(tmp_path, out_dir):
    # tree.py never heartbeats: without a clock started by the injection itself, the frozen
    # worker would never be judged hung and the job would wait forever.
    ev = tmp_path / "ev.jsonl"
    t0 = time.monotonic()
    r = run(leto_cmd("--no-status", "--recovery", "restart", "--nproc-per-node", "1",
                     "--hang-timeout", "2", "--shutdown-timeout", "1", "--events", str(ev),
                     "--inject", "hang:rank=0:after=1s", str(SCRIPTS / "tree.py")),
            base_env(out_dir), timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    evs = events(ev)
    inj = [e for e in evs if e["event"] == "inject" and e["spec"].startswith("hang")]
    hung = [e for e in evs if e["event"] == "hang_detected"]
    assert inj and hung and hung[0]["mono"] - inj[0]["mono"] >= 2.0, (inj, hung)
    assert time.monotonic() - t0 < 90


@pytest.mark.parametrize("lingers", [("12",), ("12", "8")], ids=["rank0-exits", "both-linger"])
def test_a_rank_slow_to_exit_after_its_loop_is_named_with_its_stacks(tmp_path, out_dir, lingers):
    """After `done` a rank is not judged hung (a final save may run; torchrun waits too), but
    one still running --hang-timeout after every rank of the node ended its loop (the others
    exited, or linger too, as ranks stuck together in a collective teardown would) has its
    stacks dumped into its log, and the agent says so, once; the job then ends normally."""
    logs, ev = tmp_path / "logs", tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--nproc-per-node", "2", "--hang-timeout", "1.5",
                     "--log-dir", str(logs), "--redirects", "2", "--events", str(ev),
                     str(SCRIPTS / "slow_exit.py"), "3", *lingers), base_env(out_dir), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(ev)
    said = [e for e in evs if e["event"] == "exit_lingering"]
    ranks = [1] if len(lingers) == 1 else [0, 1]
    assert sorted(e["rank"] for e in said) == ranks, said
    assert not [e for e in evs if e["event"] in ("hang_detected", "failure_detected")]
    exits = {e["rank"]: e["mono"] for e in evs if e["event"] == "exit" and e.get("rank") is not None}
    assert all(e["mono"] < exits[e["rank"]] for e in said)       # said while it still ran
    for rank in ranks:
        err = next(logs.glob(f"*/attempt_0/{rank}/stderr.log")).read_text()
        assert "stuck_in_exit" in err, err[-2000:]
        assert f"rank {rank} (active" in r.stderr and "still waiting for it to exit" in r.stderr, r.stderr[-2000:]
