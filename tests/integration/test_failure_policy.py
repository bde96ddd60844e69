"""The failure policy with real processes and signals (gloo on CPU): a failure of the script
is not recovered in place forever, a state manager gone for good ends the job, injections that
cannot fire are reported.  The trainer speaks the in-place protocol directly
(tests/integration/scripts/inplace_policy.py); the oracle is torchrun's semantics: with
`--max-restarts 0` a repeated failure ends the job with exit 1, with restarts left it restarts
the group and ends with exit 3 when they are used up."""
import os
import signal
import subprocess
import time

from fault_matrix import GEOMETRY
from leto_testing import (ROOT, SCRIPTS, assert_nothing_left, base_env, event_waiter, events,
                          inplace_cmd, kill_state_manager_until_gone, leto_cmd, of, run)

POLICY = str(SCRIPTS / "inplace_policy.py")

leto = inplace_cmd


def test_a_script_bug_at_one_step_stops_inplace_recovery_and_exits_1(tmp_path, out_dir):
    """Item 4: rank 1 raises at step 5 in every generation.  The first failure may be a HOF
    (recovered in place); the second at the same step the same way is not: exit 1."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--max-restarts", "0", POLICY, "raise", "12", "0.05", "5"),
            base_env(out_dir), timeout=150)
    assert r.returncode == 1, r.stderr[-4000:]
    evs = events(ev)
    assert [e["generation"] for e in of(evs, "promote", rank=1)] == [1]   # one in place
    assert not of(evs, "restart")
    [last] = [e for e in of(evs, "decision") if e["generation"] == 1]
    assert last["action"] == "give_up" and last["verdict"] == "deterministic"
    assert last["kind"] == "exit" and last["signature"] == "exit code 1"
    assert "failed again at step 5 the same way" in last["reason"]
    assert of(evs, "job_end")[-1]["exit_code"] == 1
    report = r.stderr[r.stderr.index("Recovery report"):]
    assert "#2 generation 1->end: rank 1 exit code 1 at step 5" in report
    assert "job ended with exit code 1" in report and "not a HOF" in report
    assert "respawned" not in report
    assert_nothing_left(evs)


def test_a_script_bug_uses_up_the_restarts_and_exits_3(tmp_path, out_dir):
    """Item 4 with restarts and @record: the traceback in the error file identifies the failure
    (exception type and innermost frame); after the restart the group fails the same way again
    and the job gives up with exit 3, as torchrun would."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--max-restarts", "1", POLICY, "record", "12", "0.05", "5"),
            base_env(out_dir), timeout=200)
    assert r.returncode == 3, r.stderr[-4000:]
    evs = events(ev)
    assert [e["generation"] for e in of(evs, "promote", rank=1)] == [1]
    assert len(of(evs, "restart")) == 1
    decisions = [e for e in of(evs, "decision") if e.get("verdict")]
    assert [(d["action"], d["verdict"]) for d in decisions] == [
        ("inplace", "transient"), ("restart", "deterministic"), ("give_up", "deterministic")]
    line = next(i for i, text in enumerate(open(POLICY), 1) if "raise ValueError(" in text)
    assert decisions[1]["signature"] == f"ValueError at {POLICY}:{line} in fail_here"
    assert decisions[1]["kind"] == "exception"
    assert of(evs, "job_end")[-1]["exit_code"] == 3
    assert_nothing_left(evs)


def test_a_trainer_that_dies_before_its_first_step_every_generation_is_not_a_hof(tmp_path,
                                                                                out_dir):
    """Item 6: rank 1 dies before reaching its first step in every generation (an active right
    after forming its group, a promoted shadow right after its promotion, like a crash in
    job.adamw() or in recovery).  The promoted generation completed no step and failed the same
    way: no second promotion; --max-restarts decides (exit 1)."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--max-restarts", "0", POLICY, "early", "12", "0.05"), base_env(out_dir),
            timeout=150)
    assert r.returncode == 1, r.stderr[-4000:]
    evs = events(ev)
    assert [e["generation"] for e in of(evs, "promote", rank=1)] == [1]
    fails = of(evs, "failure_detected", rank=1)
    assert [(f["generation"], f["step"]) for f in fails] == [(0, None), (1, None)]
    [last] = [e for e in of(evs, "decision") if e["generation"] == 1]
    assert last["verdict"] == "deterministic" and "before its first step" in last["reason"]
    assert_nothing_left(evs)


def test_failures_that_do_not_repeat_are_recovered_in_place_within_the_budget(tmp_path,
                                                                             out_dir):
    """An exception at a new step each generation is treated as a HOF and recovered in place,
    until --max-inplace-recoveries are used; the next one follows --max-restarts (exit 1).
    The promoted trainers' console lines carry the role they have now (active)."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--max-restarts", "0", "--max-inplace-recoveries", "2",
                 "--inplace-window", "600", POLICY, "drift", "14", "0.05", "3"),
            base_env(out_dir), timeout=200)
    assert r.returncode == 1, r.stderr[-4000:]
    evs = events(ev)
    fails = of(evs, "failure_detected", rank=1)
    assert [(f["generation"], f["step"]) for f in fails] == [(0, 3), (1, 5), (2, 7)]
    assert sorted({e["generation"] for e in of(evs, "promote")}) == [1, 2]
    [last] = [e for e in of(evs, "decision") if e["generation"] == 2]
    assert last["action"] == "give_up" and last["verdict"] == "transient"
    assert "--max-inplace-recoveries 2" in last["reason"]
    assert "[r0 active g1]: rank=0 gen=1 step=3" in r.stdout
    assert "[r0 shadow g1]: rank=0 gen=1 step" not in r.stdout
    assert_nothing_left(evs)


def test_a_state_manager_past_its_crash_limit_ends_the_job_at_the_next_failure(tmp_path,
                                                                              out_dir):
    """Item 5: rank 1's state manager is killed until the agent stops restarting it; the next
    trainer failure cannot be recovered in place (the retained state cannot be served): exit 4
    with the reason, no promotion."""
    ev = tmp_path / "ev.jsonl"
    p = subprocess.Popen(leto(ev, "--max-restarts", "2", str(SCRIPTS / "inplace.py"), "ok",
                              "2000", "0.05"),
                         env=base_env(out_dir), cwd=str(ROOT), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 120
        wait_for = event_waiter(p, ev, end)
        wait_for(lambda evs: len(of(evs, "spawn", role="shadow")) == 2, "the shadows")
        killed = kill_state_manager_until_gone(ev, wait_for, 1)
        [active] = of(events(ev), "spawn", role="active", rank=1)
        os.kill(active["pid"], signal.SIGKILL)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 4, err[-4000:]
    assert len(killed) == 6
    evs = events(ev)
    [gone] = of(evs, "sm_gone")
    assert gone["local_rank"] == 1 and "6 times within 60 s" in gone["reason"]
    assert not of(evs, "promote") and not of(evs, "restart")
    [last] = of(evs, "decision")
    assert last["action"] == "unrecoverable" and "state manager of slot 1" in last["reason"]
    assert "state manager of slot 1 is gone for good" in err
    report = err[err.index("Recovery report"):]
    assert "job ended with exit code 4" in report and "respawned" not in report
    assert_nothing_left(evs)


def test_a_step_triggered_injection_into_a_script_that_never_beats_is_reported(tmp_path,
                                                                              out_dir):
    """Item 10: a step-triggered injection cannot fire in a script that never reports a step,
    nor one for a restart attempt that never comes; each is a warning event and one line."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--events", str(ev), "--max-restarts", "2",
                     "--inject", "kill:rank=0:step=3",
                     "--inject", "kill:rank=0:step=1:attempt=2",
                     str(SCRIPTS / "hello.py")), base_env(out_dir), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(ev)
    unfired = {e["spec"]: e for e in of(evs, "inject_unfired")}
    assert set(unfired) == {"kill:rank=0:step=3", "kill:rank=0:step=1:attempt=2"}
    assert "never reported a training step" in unfired["kill:rank=0:step=3"]["reason"]
    assert "attempt 2 never started" in unfired["kill:rank=0:step=1:attempt=2"]["reason"]
    assert r.stderr.count("warning: injection 'kill:rank=0:step=3' never fired") == 1
    assert evs.index(unfired["kill:rank=0:step=3"]) < evs.index(of(evs, "job_end")[0])


def test_an_rmu_injection_naming_a_group_the_model_lacks_is_reported(tmp_path, out_dir):
    """Item 10 under the runtime API: the trainer sees that no protection group 77 exists when
    step 1's update is over and tells the agent (datagram `unfired`); a step the job never
    reaches is the agent's to report at the end.  Training is not disturbed.  (No in-place
    recovery is allowed, so no shadow is started: the trainer runs alone.)"""
    g = GEOMETRY
    ev = tmp_path / "ev.jsonl"
    r = run(leto_cmd("--no-status", "--standalone", "--nproc-per-node", "1", "--events", str(ev),
                     "--max-inplace-recoveries", "0",
                     "--page-bytes", str(g["page_bytes"]), "--data-pages", str(g["data_pages"]),
                     "--tier1", str(g["tier1"]), "--tier2", str(g["tier2"]),
                     "--chunk-pages", str(g["chunk_pages"]),
                     "--inject", "kill:rank=0:step=1:at=rmu.update:group=77:chunk=1",
                     "--inject", "kill:rank=0:step=9:at=rmu.load",
                     "--inject", "pages:rank=0:step=2:tier=device:group=77:count=1",
                     str(ROOT / "examples" / "gpt_inplace.py"), "--steps", "3"),
            base_env(out_dir), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    evs = events(ev)
    unfired = {e["spec"]: e for e in of(evs, "inject_unfired")}
    pages = "pages:rank=0:step=2:count=1:group=77:tier=device"
    assert set(unfired) == {"kill:rank=0:step=1:at=rmu.update:chunk=1:group=77",
                            "kill:rank=0:step=9:at=rmu.load", pages}
    assert unfired[pages]["by"] == "runtime" and "refused it" in unfired[pages]["reason"]
    rmu = unfired["kill:rank=0:step=1:at=rmu.update:chunk=1:group=77"]
    assert rmu["by"] == "runtime" and rmu["step"] == 1
    assert rmu["reason"].startswith("the model has no protection group 77: at=rmu.update of "
                                    "step 1 ran for group(s) 0..")
    late = unfired["kill:rank=0:step=9:at=rmu.load"]
    assert late["by"] == "agent" and "reported step 2 at most" in late["reason"]
    assert "can never fire: the model has no protection group 77" in r.stderr
    assert not of(evs, "failure_detected") and not of(evs, "inject")
    assert not of(evs, "spawn", role="shadow")


def test_an_error_of_the_script_the_runtime_names_is_never_recovered_in_place(tmp_path):
    """Item: a ScriptError (here the PortingError of a gradient replaced by zero_grad() in the
    second step of every process) is marked in the error file by the runtime's excepthook (the
    script has no @record), and the agent stops at once with exit 1 and the message: before,
    each promoted trainer failed one step later, and the job walked through a recovery per
    step."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto_cmd("--standalone", "--nproc-per-node", "2", "--no-status", "--max-restarts",
                     "0", "--events", str(ev), str(SCRIPTS / "script_error.py")),
            base_env(), timeout=150)
    assert r.returncode == 1, r.stderr[-4000:]
    evs = events(ev)
    assert not of(evs, "promote"), "an error of the script was recovered in place"
    [d] = [e for e in of(evs, "decision") if e.get("verdict")]
    assert d["verdict"] == "deterministic" and d["kind"] == "exception", d
    assert d["signature"].startswith("PortingError at ") and "an error of the script" in d["reason"]
    assert "is no longer its view of retained memory in step 1" in r.stderr
    assert_nothing_left(evs)


def test_retained_pages_beyond_the_node_s_descriptor_limit_are_never_recovered_in_place(tmp_path):
    """The class of the ScriptError above, met at world size 8 in the recovery harness: the
    agent's fd keepers need one descriptor per retained page, and under a hard RLIMIT_NOFILE too
    small for the job's pages the memory pool refuses a trainer's states (`FdLimit`).  Every
    generation on this node would ask for the same pages under the same limit, so the runtime
    marks it like a ScriptError: the job stops at once with the limit and its fix (before, a
    shadow was promoted, failed the same way, and only then did the job stop)."""
    import resource

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400))

    ev, out = tmp_path / "ev.jsonl", tmp_path / "out"
    out.mkdir()
    r = run(leto_cmd("--standalone", "--nproc-per-node", "2", "--no-status", "--max-restarts",
                     "0", "--events", str(ev), "--page-bytes", "4096", "--data-pages", "32",
                     str(ROOT / "examples" / "gpt_inplace.py"), "--steps", "4", "--out", str(out)),
            base_env(), timeout=150, preexec_fn=low_limit)
    assert r.returncode == 1, r.stderr[-4000:]
    evs = events(ev)
    assert not of(evs, "promote"), "a failure over the descriptor limit was recovered in place"
    [d] = [e for e in of(evs, "decision") if e.get("verdict")]
    assert d["verdict"] == "deterministic" and d["signature"].startswith("FdLimit at "), d
    assert "this node's limits" in d["reason"], d
    assert "raise the hard limit before starting leto-run" in r.stderr
    assert_nothing_left(evs)
