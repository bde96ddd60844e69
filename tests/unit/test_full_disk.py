"""A full file system under the agent's and the trainers' own files, on a real tmpfs of 64 KiB
(mounted here, unmounted after each test; skipped where mounting is not permitted):

- the keeper's allow file is rewritten in place (blocks allocated at start): allowing and
  revoking pids keeps working on a full $TMPDIR, and what does not fit is a typed, logged
  failure, never an exception into the agent;
- the loss bulletin's page is allocated at creation: a bump on a full disk cannot SIGBUS;
- the event log, shared with another appending process, never cuts others' bytes;
- a checkpoint write that DCP fails (its CheckpointException is a BaseException) is caught,
  its partial directory removed, reported, and the writer is free for the next one.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from leto_run.events import EventLog, read_events
from leto_run.state_manager.keeper import (ALLOW_SIZE, AllowFileError, FdKeeper,
                                           read_allow_file)
from leto_runtime import ckpt_writer
from leto_runtime.wire import bulletin
from leto_runtime.wire import ckpt_files as F
from leto_testing import tiny_tmpfs


@pytest.fixture
def tmpfs():
    """A fresh 64 KiB tmpfs; unmounted (and its mount point removed) whatever the test did."""
    with tiny_tmpfs("leto-full-") as d:
        yield d


def fill(d: str) -> str:
    """Fill the file system of `d` to its last block; the filler's path."""
    path = os.path.join(d, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with pytest.raises(OSError) as e:        # really full: not one more block
        with open(os.path.join(d, "probe"), "wb", buffering=0) as f:
            f.write(b"\0" * 4096)
    assert e.value.errno == errno.ENOSPC
    os.unlink(os.path.join(d, "probe"))
    return path


# ---- defect 1: the keeper's allow file -------------------------------------------------------
def test_allow_and_revoke_keep_working_on_a_full_run_dir(tmpfs):
    logs: list[str] = []
    keeper = FdKeeper(tmpfs, 0, log=logs.append)
    try:
        fill(tmpfs)
        pids = list(range(4000000, 4000040))
        for p in pids:
            assert keeper.allow_pid(p)
        assert read_allow_file(keeper.allow_path) == set(pids)
        for p in pids[:30]:
            assert keeper.revoke_pid(p)
        assert read_allow_file(keeper.allow_path) == set(pids[30:])
        assert os.path.getsize(keeper.allow_path) == ALLOW_SIZE and logs == []
        assert json.load(open(keeper.allow_path))["pids"] == pids[30:]
    finally:
        keeper.close()
    assert sorted(os.listdir(tmpfs)) == ["filler"]       # nothing of the keeper's left


def test_an_allow_that_cannot_be_written_is_logged_not_raised(tmpfs):
    """More pids than the fixed-size file holds: a typed failure, logged; the file keeps the
    last list that was written whole, and the next write that fits succeeds again."""
    logs: list[str] = []
    keeper = FdKeeper(tmpfs, 0, log=logs.append)
    try:
        fill(tmpfs)
        ok = [keeper.allow_pid(p) for p in range(4000000, 4000600)]
        assert all(ok[:300]) and not ok[-1]
        first_bad = ok.index(False)
        assert read_allow_file(keeper.allow_path) == set(range(4000000, 4000000 + first_bad))
        assert keeper.allow_error and "allow pid" in keeper.allow_error
        assert any("do not fit" in m and "revoke" in m for m in logs), logs
        for p in range(4000000, 4000600):
            keeper.revoke_pid(p)
        assert keeper.allow_pid(7) and read_allow_file(keeper.allow_path) == {7}
    finally:
        keeper.close()


def test_a_keeper_started_on_a_full_disk_fails_typed_and_leaves_nothing(tmpfs):
    fill(tmpfs)
    with pytest.raises(AllowFileError) as e:
        FdKeeper(tmpfs, 0, log=lambda m: None)
    assert e.value.errno == errno.ENOSPC and "free space" in str(e.value)
    assert sorted(os.listdir(tmpfs)) == ["filler"]


READER = """
import sys
from leto_run.state_manager.keeper import read_allow_file
valid = [set(), {11}, {11, 12}, {11, 12, 13}, {12, 13}, {13}, {21}, {21, 22}, {22}]
bad = [got for got in (read_allow_file(sys.argv[1]) for _ in range(3000)) if got not in valid]
print(len(bad), bad[:3])
"""


def test_a_reader_never_sees_a_torn_allow_list(tmp_path):
    """In-place rewrites while another process reads: every read is a list once written."""
    keeper = FdKeeper(str(tmp_path), 0, log=lambda m: None)
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            for p in (11, 12, 13):
                keeper.allow_pid(p)
            for p in (11, 12, 13):
                keeper.revoke_pid(p)
            keeper.allow_pid(21), keeper.allow_pid(22)
            keeper.revoke_pid(21), keeper.revoke_pid(22)
    t = threading.Thread(target=flip)
    t.start()
    try:
        out = subprocess.run([sys.executable, "-c", READER, keeper.allow_path],
                             capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        t.join()
        keeper.close()
    # every list the flipper writes, in its order, is valid; a torn read would be none of them
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "0", out.stdout


# ---- defect 1: the loss bulletin -------------------------------------------------------------
BUMP = """
import sys
from leto_runtime.wire import bulletin
w = bulletin.Writer(sys.argv[1])
print(w.bump(), w.bump())
"""


def test_a_bulletin_bumped_on_a_full_disk_does_not_sigbus(tmpfs):
    path = os.path.join(tmpfs, "sm0.sock.losses")
    bulletin.Writer(path).close()         # created while there is room
    fill(tmpfs)
    r = subprocess.run([sys.executable, "-c", BUMP, path], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)     # -7: SIGBUS
    assert r.stdout.split() == ["1", "2"]
    reader = bulletin.open(path)
    assert reader is not None and reader.value() == 2
    reader.close()


def test_a_bulletin_that_cannot_be_allocated_is_refused_and_left_out(tmpfs):
    fill(tmpfs)
    path = os.path.join(tmpfs, "sm0.sock.losses")
    with pytest.raises(OSError) as e:
        bulletin.Writer(path)
    assert e.value.errno == errno.ENOSPC
    assert not os.path.exists(path) and bulletin.open(path) is None


# ---- defect 13: the event log shared with another writer -------------------------------------
OTHER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
for i in range(int(sys.argv[2])):
    assert os.write(fd, (f'{{"event": "other", "i": {i}}}' + "\\n").encode()) > 0
"""


def _other_appends(path: str, n: int) -> None:
    subprocess.run([sys.executable, "-c", OTHER, path, str(n)], check=True, timeout=60)


def test_a_full_disk_never_cuts_another_writers_lines(tmpfs):
    path = os.path.join(tmpfs, "events.jsonl")
    warned: list[str] = []
    log = EventLog(path, "n0", warn=warned.append)
    log.emit("job_start", 0)
    _other_appends(path, 5)
    log.emit("spawn", 0, rank=0)
    _other_appends(path, 5)
    fill(tmpfs)
    # the file's last page has room for part of a long line: a short write
    log.emit("big", 0, pad="x" * 8000)
    log.emit("after", 0)                  # the log is degraded: in memory only, no crash
    log.close()
    recs = read_events(path)              # every line whole
    assert [r["event"] for r in recs if r["event"] != "other"] == ["job_start", "spawn"]
    assert [r["i"] for r in recs if r["event"] == "other"] == list(range(5)) * 2
    assert log.written == 2 and log.unwritten == 2 and len(warned) == 1
    assert "No space left" in warned[0] or "disk is full" in warned[0], warned
    assert [r["event"] for r in log.records][-1] == "after"


# ---- defect 2: a checkpoint write that fails -------------------------------------------------
def _big_state() -> dict:
    return {"w": torch.arange(64 * 1024, dtype=torch.float32), "step": 3}   # 256 KiB


def test_a_failed_dcp_write_is_caught_cleaned_and_reported(tmpfs, capfd):
    d = os.path.join(tmpfs, "ck")
    s = F.Settings(directory=d, every_steps=3, keep=2)
    reports: list[tuple] = []

    def report(phase, secs, **kw):
        reports.append((phase, kw))
    small = {"w": torch.ones(16), "step": 3}
    ok = ckpt_writer.write(small, 3, s, 1, report, lambda p, t: None, stall=0.0, why="test",
                           extra={"by": "trainer"})
    assert ok["ok"] and F.newest(d).step == 3
    info = ckpt_writer.write(_big_state(), 6, s, 1, report, lambda p, t: None, stall=0.0,
                             why="test", extra={"by": "trainer"})
    # (torch reports the full disk as ENOSPC or as a torn zip: the free space is named too)
    assert not info["ok"] and "bytes free, the state needs about 262144" in info["error"], info
    assert "\n" not in info["error"]              # the cause, not DCP's tracebacks
    assert os.listdir(d) == [F.name(3)]            # the partial directory removed
    assert F.newest(d).step == 3 and F.newest(d).complete     # the last complete one stays
    phase, kw = reports[-1]
    assert phase == "checkpoint" and kw["step"] == 6 and kw["dir"] == d
    assert kw["error"] == info["error"]
    err = capfd.readouterr().err
    assert f"warning: checkpoint of step 6 into {d} failed (CheckpointException" in err
    assert "partial directory is removed" in err
    # the writer is free: the next one that fits is written
    assert ckpt_writer.write(small, 9, s, 1, report, lambda p, t: None, stall=0.0, why="t",
                             extra={"by": "trainer"})["ok"]
    assert F.newest(d).step == 9


def test_the_trainer_s_writer_thread_ends_reported_and_free(tmpfs):
    """The thread `Checkpointer._take` starts: it ends without a traceback, and the next due
    checkpoint is not skipped as "still being written"."""
    d = os.path.join(tmpfs, "ck")
    reports: list[tuple] = []
    c = ckpt_writer.Checkpointer(F.Settings(directory=d, every_steps=3), 1,
                                 lambda phase, secs, **kw: reports.append((phase, kw)))
    crashed: list = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: crashed.append(a.exc_type)
    try:
        c.thread = threading.Thread(target=c._own_write, args=(_big_state(), 3, 0.0, "t"))
        c.thread.start()
        assert c._idle_within(120)
    finally:
        threading.excepthook = old_hook
    assert crashed == [] and not c._writing()
    assert reports and "error" in reports[-1][1] and os.listdir(d) == []


def test_the_shadow_s_failed_write_is_reported_to_the_active(tmpfs):
    """The shadow's write thread (`SnapshotServer._write_now`) over a real TCPStore: the
    active reads a report naming the failure, instead of waiting REPORT_CAP_S for none."""
    import datetime

    import torch.distributed as dist

    from leto_runtime import ckpt_handshake as H
    from leto_runtime.ckpt_snapshot import SnapshotServer

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    hs = H.Handshake(lambda: store, 1, 0)
    d = os.path.join(tmpfs, "ck")

    class Faults:
        def fire_in_thread(self, point, step):
            pass

    class Job:                       # what the write reads of the shadow's job
        world_size, faults = 1, Faults()

        def _report_phase(self, phase, secs, **kw):
            pass
    srv = object.__new__(SnapshotServer)
    srv.job, srv.settings, srv.hs, srv.epoch = Job(), F.Settings(directory=d), hs, 0
    srv.host_lock, srv.write_busy, srv.host = threading.Lock(), True, {}
    srv.stopping = threading.Event()
    srv._write_now(0, 6, {"why": "t"}, [_big_state()], "host", 0.0)
    got = hs.written(0, 0)
    assert got is not None and got["ok"] is False and "bytes free" in got["error"], got
    assert not srv.write_busy and os.listdir(d) == []
