"""In-place HOF recovery with shadows (real processes, real signals, gloo): a failed active's
generation is replaced by the pre-started shadows of the next one, the survivors are killed as
collateral, fresh shadows follow, and nothing is left behind.  The trainer script speaks the
protocol directly (tests/integration/scripts/inplace.py)."""
from pathlib import Path

import pytest
from leto_testing import SCRIPTS, assert_nothing_left, base_env, events, inplace_cmd, of, run

SCRIPT = str(SCRIPTS / "inplace.py")

leto = inplace_cmd


def test_kill_of_one_active_promotes_every_shadow(tmp_path, out_dir):
    ev, logs = tmp_path / "ev.jsonl", tmp_path / "logs"
    r = run(leto(ev, "--log-dir", str(logs), "--tee", "3", "--inject", "kill:rank=1:step=5",
                 SCRIPT, "ok", "10", "0.1"), base_env(out_dir), timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 1 last 9"
    evs = events(ev)
    [fail] = of(evs, "failure_detected")
    assert (fail["rank"], fail["generation"], fail["step"]) == (1, 0, 5)
    # seen as its exit began (leto_run/exit_notice.py), with the status its reap then gave
    # (the survivor, killed as collateral, may report its exit too: it is not acted on)
    [began] = of(evs, "exit_started", pid=fail["pid"])
    assert not [e for e in of(evs, "exit_started") if e["acted"] and e is not began]
    [dead] = of(evs, "exit", pid=fail["pid"])
    assert began["acted"] and (began["pid"], began["exitcode"]) == (fail["pid"], -9), began
    assert dead["exitcode"] == -9 and fail["mono"] == began["mono"] <= dead["mono"]
    [hof] = of(evs, "hof")
    assert hof["generation"] == 0 and hof["rank"] == 1 and hof["first_writer"]
    [demote] = of(evs, "demote")
    assert demote["rank"] == 0 and demote["mode"] == "replace" and demote["generation"] == 0
    collateral = of(evs, "exit", collateral=True)
    assert [e["rank"] for e in collateral] == [0]
    promotes = of(evs, "promote", generation=1)
    assert sorted(e["rank"] for e in promotes) == [0, 1]
    shadows1 = {e["pid"] for e in of(evs, "spawn", role="shadow", generation=1)}
    assert {e["pid"] for e in promotes} == shadows1
    assert sorted(e["rank"] for e in of(evs, "spawn", role="shadow", generation=2)) == [0, 1]
    assert sorted(e["rank"] for e in of(evs, "promoted", generation=1)) == [0, 1]
    assert of(evs, "phase", generation=1, phase="agree")
    assert not of(evs, "restart") and of(evs, "job_end")[-1]["exit_code"] == 0
    assert len(of(evs, "failure_detected")) == 1          # the survivor's death is collateral
    # Shadows share their rank's log file, each line prefixed with role and generation.
    out1 = next(logs.glob("*/attempt_0/1/stdout.log")).read_text()
    assert "[r1 shadow g1]: rank=1 gen=1 step=9" in out1 and "rank=1 gen=0 step=0" in out1
    assert "in place: rank 1 Signal 9 (SIGKILL) at step 5" in r.stderr
    assert_nothing_left(evs)


@pytest.mark.parametrize("mode", ["ok", "forkchild"])
def test_with_the_exit_fence_the_promotion_waits_for_its_verdict(tmp_path, out_dir, mode):
    """LETO_EXIT_FENCE=on: the agent behaves as on a GPU machine (leto_run/exit_notice.py).
    The kill is judged at the notice; the shadows are promoted only once the dead trainer's
    fence said quiet -- with `forkchild`, once its forked child, which holds the fence as it
    would hold the device files, is gone too (the agent kills the dead trainer's group)."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--inject", "kill:rank=1:step=5", SCRIPT, mode, "10", "0.1"),
            base_env(out_dir, LETO_EXIT_FENCE="on"), timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 1 last 9"
    evs = events(ev)
    [fail] = of(evs, "failure_detected")
    [began] = of(evs, "exit_started", pid=fail["pid"])
    assert began["acted"] and fail["mono"] == began["mono"]
    [fence] = of(evs, "exit_fence", pid=fail["pid"])
    assert fence["verdict"] == "quiet" and fence["mono"] >= began["mono"], fence
    promotes = of(evs, "promote", generation=1)
    assert sorted(e["rank"] for e in promotes) == [0, 1]
    assert all(e["mono"] >= fence["mono"] for e in promotes), (fence, promotes)
    # every trainer's fence is watched: the shadows' and survivors' too, never untrusted
    assert not of(evs, "exit_fence", verdict="untrusted")
    assert_nothing_left(evs)


def test_a_dead_trainer_whose_device_files_outlive_the_kill_stops_the_job(tmp_path, out_dir):
    """LETO_EXIT_FENCE=on (as on a GPU machine): the killed trainer's child left its session
    and holds the fence (as it would hold the dead trainer's device files, and so its GPU work)
    past the demotion's bound: no shadow is promoted onto the retained state; the job stops
    with exit 4, saying why, and leaves nothing behind."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--shutdown-timeout", "3", "--inject", "kill:rank=1:step=5", SCRIPT,
                 "setsidchild", "10", "0.1"), base_env(out_dir, LETO_EXIT_FENCE="on"), timeout=150)
    assert r.returncode == 4, r.stderr[-4000:]
    assert "did not stop within 10 s of SIGKILL" in r.stderr and "not reused" in r.stderr
    evs = events(ev)
    assert of(evs, "failure_detected") and not of(evs, "promote", generation=1)
    assert_nothing_left(evs)


def test_a_stray_holding_a_dead_trainer_s_device_files_is_stopped_before_the_promotion(
        tmp_path, out_dir):
    """LETO_EXIT_FENCE=on (as on a GPU machine) and the killed trainer's fence untrusted (a
    device file below it), so the reap decides -- but a daemon it forked holds its device files
    ("device files" here: LETO_DEVICE_FILES pointed at the test's own file) and keeps working,
    as a forked child keeps a dead trainer's context and kernels alive.  The agent kills that
    orphan and waits for it before promoting: every write of it comes before every promotion,
    though it was still writing after the death."""
    ev, dev = tmp_path / "ev.jsonl", tmp_path / "nvidia-fake"
    r = run(leto(ev, "--inject", "kill:rank=1:step=5", SCRIPT, "devicechild", "10", "0.1"),
            base_env(out_dir, LETO_EXIT_FENCE="on", LETO_DEVICE_FILES=str(dev)), timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 1 last 9"
    evs = events(ev)
    [fail] = of(evs, "failure_detected")
    [fence] = of(evs, "exit_fence", pid=fail["pid"])
    assert fence["verdict"] == "untrusted", fence
    [strays] = of(evs, "device_strays", generation=0)
    assert len(strays["pids"]) == 1 and strays["running"] == [] and strays["of"] == [fail["pid"]]
    writes = [float(x) for x in Path(f"{dev}0.writes").read_text().split()]
    promotes = of(evs, "promote", generation=1)
    assert sorted(e["rank"] for e in promotes) == [0, 1]
    assert fail["mono"] < max(writes) < min(e["mono"] for e in promotes), \
        (fail["mono"], max(writes), promotes)
    assert "orphaned process(es) holding device files" in r.stderr
    assert_nothing_left(evs)


def test_two_failures_in_successive_generations(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--inject", "kill:rank=1:step=3", "--inject", "kill:rank=0:step=6:gen=1",
                 SCRIPT, "ok", "9", "0.1"), base_env(out_dir), timeout=150)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 2 last 8"
    evs = events(ev)
    fails = of(evs, "failure_detected")
    assert [(f["generation"], f["rank"]) for f in fails] == [(0, 1), (1, 0)]
    assert sorted(e["rank"] for e in of(evs, "promote", generation=2)) == [0, 1]
    assert [e["rank"] for e in of(evs, "demote", generation=1)] == [1]
    assert sorted(e["rank"] for e in of(evs, "spawn", role="shadow", generation=3)) == [0, 1]
    assert "#2 generation 1->2 in place" in r.stderr
    assert_nothing_left(evs)


def test_hang_is_recovered_in_place(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--hang-timeout", "2", "--inject", "hang:rank=0:step=4",
                 SCRIPT, "ok", "8", "0.1"), base_env(out_dir), timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    evs = events(ev)
    hangs = of(evs, "hang_detected")
    assert hangs and hangs[0]["rank"] == 0 and len(hangs) == 1   # rank 1 is collateral
    assert sorted(e["rank"] for e in of(evs, "promote", generation=1)) == [0, 1]
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 1 last 7"
    assert_nothing_left(evs)


def test_unrecoverable_exit_ends_the_job(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--max-restarts", "3", SCRIPT, "unrecoverable", "10", "0.1"),
            base_env(out_dir), timeout=120)
    assert r.returncode == 4, r.stderr[-4000:]
    assert "cannot be recovered in place" in r.stderr
    assert "no checkpoint to fall back to (checkpointing is off (no --checkpoint-dir)" in r.stderr
    evs = events(ev)
    assert not of(evs, "promote") and not of(evs, "restart")
    assert of(evs, "job_end")[-1]["exit_code"] == 4
    assert_nothing_left(evs)


def test_script_without_init_keeps_restart_semantics(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--max-restarts", "1", str(SCRIPTS / "allreduce.py"), "--fail-rank", "1",
                 "--fail-step", "2"), base_env(out_dir), timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (out_dir / "result").read_text().split()[2] == "1"      # attempt 1 finished
    evs = events(ev)
    assert not of(evs, "spawn", role="shadow") and not of(evs, "promote")
    assert len(of(evs, "restart")) == 1 and of(evs, "inplace_fallback")
    assert_nothing_left(evs)


def test_shadow_death_before_promotion_respawns_with_a_new_epoch(tmp_path, out_dir):
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, "--inject", "kill:rank=1:step=5", SCRIPT, "shadowdie", "9", "0.1"),
            base_env(out_dir), timeout=150)
    assert r.returncode == 0, r.stderr[-4000:]
    evs = events(ev)
    died = of(evs, "shadow_exit", generation=1)
    assert died and died[0]["rank"] == 1 and died[0]["epoch"] == 0
    [respawn] = of(evs, "shadow_respawn")
    assert respawn["epoch"] == 1 and respawn["generation"] == 1
    epoch1 = of(evs, "spawn", role="shadow", generation=1, epoch=1)
    assert sorted(e["rank"] for e in epoch1) == [0, 1]
    promotes = of(evs, "promote", generation=1)
    assert {e["pid"] for e in promotes} == {e["pid"] for e in epoch1}
    assert all(e["epoch"] == 1 for e in promotes)
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 1 last 8"
    assert_nothing_left(evs)


def test_a_reclaim_request_reaches_the_controller_and_is_answered_with_its_reason(tmp_path,
                                                                                  out_dir):
    """The `reclaim` datagram the lending allocator sends (leto_runtime.rmu.lend's message, here
    from a script) is accepted from the active and judged by the controller; on a machine with
    no driver to observe there is nothing to reclaim, so the shadows keep their level, the agent
    says why, and training goes on."""
    ev = tmp_path / "ev.jsonl"
    r = run(leto(ev, SCRIPT, "reclaim", "6", "0.1"), base_env(out_dir), timeout=150)
    assert r.returncode == 0, r.stderr[-4000:]
    evs = events(ev)
    [rec] = of(evs, "reclaim")
    assert rec["rank"] == 0 and rec["bytes"] == 1 << 30 and rec["levels"] is None, rec
    assert "no driver" in rec["reason"] and "needs 1024 MiB more" in r.stderr
    assert not of(evs, "preinit"), "a shadow moved with nothing observed"
    for rank in (0, 1):
        assert (out_dir / f"result_{rank}").read_text() == "gen 0 last 5"
    assert_nothing_left(evs)
