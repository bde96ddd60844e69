"""Checkpoint fallback (docs/CHECKPOINTS.md): failures in-place recovery cannot take resume from the
newest complete checkpoint, exactly; and checkpoints taken by rank 0's shadow or by its active.

The reference is examples/byo_train.py under torchrun with stock torch and no failure; every
leto-run job here must log the reference's loss and lrs at every step it ran (the redone steps
after a fallback included) and end with the reference's final model and optimizer state.  The
faults are real: SIGKILLs of the writer in the middle of a checkpoint's write (the
`checkpoint.write` point: its files written, the manifest not) and of the shadow between its
copy and its claim (`checkpoint.snapshot`), page losses beyond the parity's
tolerance, and SIGKILLs of a state manager until the agent gives it up.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from leto_testing import (ROOT, assert_nothing_left, base_env, compare_runs, event_waiter,
                          events, kill_state_manager_until_gone, leto_cmd, of, run, shared_dir,
                          torchrun_cmd)

SCRIPT = str(ROOT / "examples" / "byo_train.py")
GEOMETRY = ("--page-bytes", "4096", "--data-pages", "4", "--tier1", "2", "--tier2", "1",
            "--chunk-pages", "2")
STEPS = 12


def _leto(ev: Path, ck: Path, *args: str) -> list[str]:
    return leto_cmd("--standalone", "--nproc-per-node", "2", "--no-status", *GEOMETRY,
                    "--events", str(ev), "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
                    *args)


def _exact_run(reference, tmp_path: Path, step_time: str, *args: str) -> tuple[list, str, Path]:
    """leto-run with `args` over the script's STEPS steps: it must end with code 0, bit-exact
    against torchrun.  -> (its events, its stderr, the checkpoint directory)."""
    out, ck, ev = tmp_path / "out", tmp_path / "ck", tmp_path / "ev.jsonl"
    out.mkdir()
    p = run(_leto(ev, ck, *args, SCRIPT, "--steps", str(STEPS), "--step-time", step_time, "--out", str(out)),
            base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    compare_runs(reference(STEPS), out, 2, range(STEPS), p.stderr[-4000:])
    return events(ev), p.stderr, ck


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`get(steps)`: the fault-free torchrun run of `steps` steps (once per test run)."""
    def get(steps: int) -> Path:
        def build(d: Path) -> None:
            p = run(torchrun_cmd("--standalone", "--nproc-per-node", "2", SCRIPT, "--steps",
                                 str(steps), "--out", str(d)), base_env(), timeout=300)
            assert p.returncode == 0, p.stderr[-3000:]
        return shared_dir(tmp_path_factory, f"ckpt_ref{steps}", build)
    return get


def test_a_torn_checkpoint_is_skipped_and_page_losses_beyond_tolerance_fall_back_exactly(
        reference, tmp_path):
    """The checkpoints are the shadow's (rank 0's shadow copies retained memory while the active
    computes; `--checkpoint-writer shadow`).  The shadow is SIGKILLed while it writes the checkpoint of step 6 (its partial
    directory stays; a new shadow is started), then 3 data pages of a group with tolerance 2
    are lost at step 8: the fallback skips the torn checkpoint, loads step 3, redoes 3.. and
    ends bit-exact.  In that attempt the checkpoint of step 6 is the shadow's again, and it
    resumes under plain torchrun, bit-exactly; then the shadow is SIGKILLed after its copy of
    step 9 and before its claim: the active sees it gone and takes the checkpoint itself."""
    out, ck, ev = tmp_path / "out", tmp_path / "ck", tmp_path / "ev.jsonl"
    out.mkdir()
    ref = reference(STEPS)
    # writer "shadow": a due checkpoint waits for a shadow that is starting (after a fallback,
    # after the shadows were restarted), so which checkpoint is whose does not depend on timing
    p = run(_leto(ev, ck, "--checkpoint-keep", "3", "--checkpoint-writer", "shadow",
                  "--inject", "kill:rank=0:step=6:at=checkpoint.write:gen=1",
                  "--inject", "pages:rank=0:count=3:tier=device:step=8",
                  "--inject", "kill:rank=0:step=9:at=checkpoint.snapshot:gen=1:attempt=1",
                  # 6 s between checkpoints: on a busy machine the shadow's write (at nice 19)
                  # has taken 4 s, and one still in flight skips the next (a checkpoint_skipped)
                  SCRIPT, "--steps", str(STEPS), "--step-time", "2.0", "--out", str(out)),
            base_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    compare_runs(ref, out, 2, range(STEPS), p.stderr[-4000:])
    evs = events(ev)
    [fb] = of(evs, "fallback")
    assert fb["step"] == 3 and fb["path"] == str(ck / "step_000000003"), fb
    assert not of(evs, "phase", phase="checkpoint_skipped"), "a write outlasted 3 steps (busy machine)"
    assert ".partial-step_000000006-" in fb["reason"] and "torn" in fb["reason"]
    assert [e["action"] for e in of(evs, "decision")][-2:] == ["fall_back", "succeed"]
    written = {e["step"]: e["by"] for e in of(evs, "phase", phase="checkpoint") if e.get("path")
               and e["mono"] > fb["mono"]}
    assert written == {6: "shadow", 9: "trainer", 12: "trainer"}, written
    assert "checkpoint of step 9: the shadow did not take it" in p.stderr
    assert sorted(os.listdir(ck)) == ["step_000000006", "step_000000009", "step_000000012"]
    assert_nothing_left(evs)
    # A user can leave Leto at any time: the checkpoint of step 6 (the shadow's, written after
    # the fallback) loads with stock torch.distributed.checkpoint into the same script under
    # torchrun, which runs steps 6.. exactly as the uninterrupted run.
    back = tmp_path / "back"
    back.mkdir()
    q = run(torchrun_cmd("--standalone", "--nproc-per-node", "2", SCRIPT, "--steps", str(STEPS),
                         "--resume", "--ckpt", str(ck / "step_000000006"), "--out", str(back)),
            base_env(), timeout=300)
    assert q.returncode == 0, q.stderr[-4000:]
    compare_runs(ref, back, 2, range(6, STEPS), q.stderr[-4000:])


def test_the_trainer_writer_survives_a_kill_during_its_write(reference, tmp_path):
    """`--checkpoint-writer trainer`: rank 0's active copies and writes the checkpoints itself;
    it is SIGKILLed while it writes the one of step 6 (a HOF, recovered in place: the partial
    directory stays, and is never loaded), and the job ends bit-exact with the checkpoints of
    9 and 12, which are the trainer's."""
    evs, _, ck = _exact_run(reference, tmp_path, "0.3", "--checkpoint-writer", "trainer",
                            "--inject", "kill:rank=0:step=6:at=checkpoint.write")
    assert {e["by"] for e in of(evs, "phase", phase="checkpoint") if e.get("path")} == {"trainer"}
    assert sorted(os.listdir(ck)) == ["step_000000009", "step_000000012"]
    assert_nothing_left(evs)


def test_a_kill_during_the_final_checkpoint_is_recovered_and_the_final_checkpoint_written(reference,
                                                                                         tmp_path):
    """Rank 0's active (`--checkpoint-writer trainer`) is SIGKILLed while it writes the final
    checkpoint (step 12), after its training loop ended and it said so (its `bye`): a death
    then is still a failure, not a success.  The in-place recovery's promoted trainer finds
    every update done and writes the final checkpoint itself; the job ends with code 0,
    bit-exact, and the final checkpoint is complete."""
    evs, _, ck = _exact_run(reference, tmp_path, "0.3", "--checkpoint-writer", "trainer",
                            "--inject", f"kill:rank=0:step={STEPS}:at=checkpoint.write")
    assert of(evs, "promote"), "the death after the loop was not recovered"
    from leto_runtime.wire import ckpt_files as F
    names = sorted(n for n in os.listdir(ck) if not n.startswith("."))     # (a partial is hidden)
    assert names == [F.name(9), F.name(STEPS)], os.listdir(ck)          # --checkpoint-keep 2
    assert F.check(str(ck / F.name(STEPS))).complete
    [final] = [e for e in of(evs, "phase", phase="checkpoint") if e.get("path") and e["step"] == STEPS]
    assert final["generation"] >= 1, final             # written by the promoted trainer
    assert_nothing_left(evs)


def test_a_state_manager_gone_for_good_falls_back_to_the_checkpoint_exactly(reference,
                                                                           tmp_path):
    """Slot 1's state manager is SIGKILLed until the agent gives it up; then rank 1's trainer is
    SIGKILLed: in-place recovery is impossible (the slot's retained state cannot be served), so
    the job falls back to its newest checkpoint, with fresh state managers, and ends bit-exact."""
    out, ck, ev = tmp_path / "out", tmp_path / "ck", tmp_path / "ev.jsonl"
    out.mkdir()
    p = subprocess.Popen(_leto(ev, ck, SCRIPT, "--steps", str(STEPS), "--step-time", "1.0",
                               "--out", str(out)),
                         env=base_env(), cwd=str(ROOT), text=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 200
        wait_for = event_waiter(p, ev, end)
        wait_for(lambda evs: [e for e in of(evs, "phase", phase="checkpoint") if e.get("path")],
                 "the first complete checkpoint")
        kill_state_manager_until_gone(ev, wait_for, 1)
        [active] = of(events(ev), "spawn", role="active", rank=1)
        os.kill(active["pid"], signal.SIGKILL)
        _, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-4000:]
    evs = events(ev)
    [fb] = of(evs, "fallback")
    assert "gone for good" in fb["reason"], fb
    compare_runs(reference(STEPS), out, 2, range(STEPS), err[-4000:])
    assert_nothing_left(evs)


def test_the_final_checkpoint_waiting_for_a_stuck_write_is_no_hang(reference, tmp_path):
    """The trainer's write of step 3 never ends (an injected hang in its writer thread, as a
    stuck file system would leave it): the checkpoints of 6 and 9 are skipped, and the final
    one waits for that write, at most --pg-timeout, then is skipped too, each with a reason.
    That wait comes after the training loop: it is no hang (no heartbeat for longer than
    --hang-timeout), the job ends with code 0, bit-exact, and nothing is recovered."""
    evs, stderr, _ = _exact_run(reference, tmp_path, "0.1", "--checkpoint-writer", "trainer",
                                "--hang-timeout", "6", "--pg-timeout", "15",
                                "--inject", "hang:rank=0:step=3:at=checkpoint.write")
    assert not of(evs, "hang_detected") and not of(evs, "promote"), stderr[-4000:]
    skipped = {e["step"]: e["reason"] for e in of(evs, "phase", phase="checkpoint_skipped")}
    assert sorted(skipped) == [6, 9, 12], skipped
    assert skipped[12] == "the previous one is still being written after 15 s", skipped
    assert not [e for e in of(evs, "phase", phase="checkpoint") if e.get("path")]
    assert "did not finish within 15 s" in stderr


@pytest.mark.parametrize("mode", ["inplace", "restart"])
def test_a_failed_checkpoint_write_warns_and_training_goes_on(reference, tmp_path, mode):
    """The checkpoint directory is replaced by a file after the start (as a full or vanished
    file system would fail the write): each due checkpoint fails with a warning event (in both
    recovery modes), training goes on and ends exactly, and no partial directory is left."""
    out, ck, ev = tmp_path / "out", tmp_path / "ck", tmp_path / "ev.jsonl"
    out.mkdir()
    p = subprocess.Popen(_leto(ev, ck, "--recovery", mode, SCRIPT, "--steps", str(STEPS),
                               "--step-time", "0.1", "--out", str(out)),
                         env=base_env(), cwd=str(ROOT), text=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 200
        event_waiter(p, ev, end)(lambda evs: of(evs, "spawn", role="active"), "the actives")
        shutil.rmtree(ck)             # (the agent made it, with its lock file, at the start)
        ck.write_text("a file where the checkpoints should go")
        _, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-4000:]
    compare_runs(reference(STEPS), out, 2, range(STEPS), err[-4000:])
    failed = [e for e in of(events(ev), "phase", phase="checkpoint") if e.get("error")]
    # A due checkpoint fails, or -- a write in flight, e.g. the shadow's at nice 19 on a busy
    # machine -- is skipped with a reason; the final one waits for that write instead.
    skipped = of(events(ev), "phase", phase="checkpoint_skipped")
    assert all("still being written" in e["reason"] for e in skipped), skipped
    assert sorted(e["step"] for e in failed + skipped) == [3, 6, 9, 12], (failed, skipped)
    assert 12 in [e["step"] for e in failed], failed
    assert "training goes on" in err
    assert ck.read_text() == "a file where the checkpoints should go"


def test_checkpoints_of_a_job_adamw_script_are_refused_at_the_start(tmp_path):
    """job.adamw()'s state has no torch format: --checkpoint-dir is refused before the first
    step, with the fix, as a script error (never recovered in place), not a crash at the first
    checkpoint."""
    ck, ev = tmp_path / "ck", tmp_path / "ev.jsonl"
    p = run(_leto(ev, ck, str(ROOT / "examples" / "gpt_inplace.py"), "--steps", "6"),
            base_env(), timeout=300)
    assert p.returncode == 1, p.stderr[-4000:]
    assert "--checkpoint-dir needs job.optimizer(torch_opt, ...)" in p.stderr
    assert not of(events(ev), "promote") and os.listdir(ck) == []     # nothing left in it
