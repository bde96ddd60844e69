"""Checkpoints into a real file system too small for one (a 64 KiB tmpfs, mounted here): DCP
fails every write with a CheckpointException -- a BaseException -- and the job must still end
on time and exit 0, every due checkpoint reported failed (by the trainer's writer or by the
shadow's), no partial directory left, and no checkpoint pretended (docs/CHECKPOINTS.md)."""
from __future__ import annotations

import os
import time

import pytest

from leto_runtime.wire import ckpt_files as F
from leto_testing import (ROOT, assert_nothing_left, base_env, events, leto_cmd, of, run,
                          tiny_tmpfs)

SCRIPT = str(ROOT / "examples" / "byo_train.py")
GEOMETRY = ("--page-bytes", "4096", "--data-pages", "4", "--tier1", "2", "--tier2", "1",
            "--chunk-pages", "2")
STEPS = 12


@pytest.fixture
def tiny_fs():
    with tiny_tmpfs("leto-ckfull-") as d:
        yield d


@pytest.mark.parametrize("writer", ["trainer", "auto"])
def test_checkpoints_that_cannot_fit_are_reported_and_the_job_ends_on_time(tiny_fs, tmp_path,
                                                                         writer):
    ck, ev = os.path.join(tiny_fs, "ck"), tmp_path / "ev.jsonl"
    t0 = time.monotonic()
    p = run(leto_cmd("--standalone", "--nproc-per-node", "1", "--no-status", *GEOMETRY,
                     "--events", str(ev), "--checkpoint-dir", ck, "--checkpoint-every", "3",
                     "--checkpoint-writer", writer, SCRIPT, "--steps", str(STEPS),
                     "--step-time", "0.1", "--width", "256"), base_env(), timeout=240)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-4000:]
    # Before the fix the writer's thread died unreported: the end waited REPORT_CAP_S (300 s).
    assert took < 150, took
    evs = events(ev)
    failed = [e for e in of(evs, "phase", phase="checkpoint") if e.get("error")]
    skipped = of(evs, "phase", phase="checkpoint_skipped")
    assert sorted(e["step"] for e in failed + skipped) == [3, 6, 9, 12], (failed, skipped)
    assert all("CheckpointException" in e["error"] and e["dir"] == ck for e in failed), failed
    assert not [e for e in of(evs, "phase", phase="checkpoint") if e.get("path")]
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    assert f"warning: checkpoint of step 12 into {ck} failed" in p.stderr
    assert not [n for n in os.listdir(ck) if n.startswith((".partial-", "step_"))]
    assert F.newest(ck) is None                  # no checkpoint pretended
    assert_nothing_left(evs)
