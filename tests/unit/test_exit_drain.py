"""The drain words (leto_runtime/drain.py, leto_runtime/wire/exit_page.py) and the agent's
"drained" verdict (leto_run/exit_notice.py), with real processes and real signals.

A child arms its exit page as a trainer does and stores drain words into it as the trainer's
`Drain` does (its host stores); this test then plays the GPU: it stores the stream-ordered
`done` words the device would write, through its own mapping of the same page.  The oracle is
the rule of `exit_page.drain_verdict` itself, stated here as cases: "drained" is posted only for
a dead process (every thread past PF_EXITING), only when its intent names an epoch and every
slot's done word has reached it, and never for a death inside an open window.  On the GPU,
tests/gpu/test_exit_drain_gpu.py checks the same verdict against a killed kernel's writes."""
from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from leto_run.exit_notice import ExitNotices
from leto_runtime.wire import contract as C
from leto_runtime.wire import exit_page as X

CHILD = r"""
import sys, time
import numpy as np
import leto_runtime                      # arms the notice (the env var)
from leto_runtime import exit_notice
from leto_runtime.wire import exit_page as X
w = np.frombuffer(exit_notice.page(), dtype=np.uint64)
intent, done = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",") if x]
for i, d in enumerate(done):
    w[X.DONE_AT // 8 + i] = d
np.frombuffer(exit_notice.page(), dtype=np.uint32)[X.SLOTS_AT // 4] = len(done)
w[X.INTENT_AT // 8] = intent
print("ready", flush=True)
time.sleep(600)
"""


class RoomyNotices(ExitNotices):
    """The agent's notices with the device-memory check answered "room" (this machine has no
    device: `room` reads NVML, which `test_without_nvml_nothing_is_drained` checks here)."""

    def room(self, pid):
        return True, "no device here"


@pytest.fixture
def notices():
    n = RoomyNotices(enabled=True, gpu=True)
    yield n
    n.close()


def _start(notices, intent: int, done: list[int]):
    fd, page = notices.page()
    mine = mmap.mmap(fd, X.PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    env = dict(os.environ, **{C.LETO_EXIT_NOTICE_FD: str(fd)})
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(intent), ",".join(map(str, done))],
                         env=env, pass_fds=(fd,), stdout=subprocess.PIPE, text=True)
    os.close(fd)
    notices.watch(p.pid, page)
    assert p.stdout.readline().strip() == "ready"
    return p, mine


def _kinds(notices, pid: int, seconds: float, began: bool = True) -> dict:
    """The first mono of each kind posted for `pid` within `seconds` (extended, on a busy
    machine, up to 20 s until the "began" notice is there when `began`)."""
    got, t0 = {}, time.monotonic()
    while time.monotonic() < t0 + seconds or (began and "began" not in got
                                               and time.monotonic() < t0 + 20):
        for n in notices.drain():
            if n[0] == pid:
                got.setdefault(n[3], n[2])
        time.sleep(0.005)
    return got


def _stop(p) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(30)


def test_drained_is_posted_once_every_stream_reached_the_epoch_and_not_before(notices):
    p, mine = _start(notices, 5, [5, 4])
    try:
        os.kill(p.pid, signal.SIGKILL)
        first = _kinds(notices, p.pid, 0.5)
        assert "began" in first and "drained" not in first, first     # slot 1 still at 4
        t_done = time.monotonic()
        np.frombuffer(mine, dtype=np.uint64)[X.DONE_AT // 8 + 1] = 5   # the GPU's sentinel
        later = _kinds(notices, p.pid, 1.0, began=False)
        assert "drained" in later and later["drained"] >= t_done, later
    finally:
        _stop(p)
        mine.close()


@pytest.mark.parametrize("intent,done", [(0, [3]), (0, []), (3, []), (4, [5])])
def test_a_death_the_words_do_not_cover_is_never_drained(notices, intent, done):
    """Died with its window open (intent 0), no stream closed, or a done word past the intent."""
    p, mine = _start(notices, intent, done)
    try:
        os.kill(p.pid, signal.SIGKILL)
        got = _kinds(notices, p.pid, 0.6)
        assert "began" in got and "drained" not in got, got
    finally:
        _stop(p)
        mine.close()


def test_a_living_process_s_words_prove_nothing(notices):
    p, mine = _start(notices, 2, [2, 2])
    try:
        assert _kinds(notices, p.pid, 0.4, began=False) == {}
    finally:
        _stop(p)
        mine.close()


@pytest.mark.parametrize("how", ["drain off", "no NVML"])
def test_with_the_drain_off_or_no_device_memory_seen_only_the_notice_is_posted(how):
    """`LETO_EXIT_DRAIN=0`; or NVML cannot say whether the device has room beside the dead
    process's memory (none here): the fence decides."""
    if how == "drain off":
        notices = RoomyNotices(enabled=True, gpu=True, drain=False)
    else:
        from leto_run.nvml import Nvml
        assert Nvml.open() is None, "this test needs a machine without NVML"
        notices = ExitNotices(enabled=True, gpu=True)
    try:
        p, mine = _start(notices, 2, [2])
        os.kill(p.pid, signal.SIGKILL)
        got = _kinds(notices, p.pid, 0.5)
        assert "began" in got and "drained" not in got, got
        _stop(p)
        mine.close()
    finally:
        notices.close()


def test_a_reused_pid_s_predecessor_s_posts_are_dropped(notices):
    """A waiter posts under its watch's token; once a later spawn got the same pid (a new
    watch), what the earlier waiter still posts is dropped by the agent's drain -- the new
    process must not inherit a "drained" -- and the earlier waiter stops."""
    p, mine = _start(notices, 3, [3])
    try:
        old = notices._tokens[p.pid]
        notices.watch(p.pid, mmap.mmap(-1, X.PAGE))       # a new process with the same pid
        new = notices._tokens[p.pid]
        notices._post(p.pid, -9, time.monotonic(), "drained", old)   # a late post of the first
        notices._post(p.pid, -9, time.monotonic(), "began", new)
        assert [n[3] for n in notices.drain()] == ["began"]
        os.kill(p.pid, signal.SIGKILL)                   # its waiter was stopped: nothing
        assert _kinds(notices, p.pid, 0.6, began=False) == {}
    finally:
        _stop(p)
        mine.close()


def test_room_beside_the_dead():
    from leto_run.exit_notice import ROOM_SLACK, room_beside_the_dead
    held = 10 << 30
    assert room_beside_the_dead(held + ROOM_SLACK, held)[0]
    ok, why = room_beside_the_dead(held + ROOM_SLACK - 1, held)
    assert not ok and "wait for the driver" in why


def test_the_rule():
    V = X.drain_verdict
    assert V(7, [7])[0] == V(7, [7, 7, 7])[0] == "drained"
    assert V(7, [6, 7])[0] == "pending"
    assert V(0, [0])[0] == V(0, [7])[0] == V(7, [])[0] == V(7, [8, 7])[0] == "unprovable"
    assert V(7, [7] * (X.MAX_SLOTS + 1))[0] == "unprovable"
    # the words sit after the mutex and the state, inside the page
    assert X.MUTEX_BYTES <= X.PID_AT + 4 <= X.INTENT_AT < X.SLOTS_AT < X.DONE_AT
    assert X.DONE_AT + 8 * X.MAX_SLOTS <= X.PAGE


def test_the_trainer_side_without_a_gpu_falls_back_to_the_fence():
    """CPU: no drain (`for_device` is OFF).  A `Drain` whose close cannot reach CUDA turns
    itself off with intent 0 -- the agent then never proves anything for this process."""
    from leto_runtime import drain as D
    assert D.for_device("cpu") is D.OFF and not D.OFF.on
    page = mmap.mmap(-1, X.PAGE)
    d = D.Drain(page)
    words = np.frombuffer(page, dtype=np.uint64)
    words[X.INTENT_AT // 8] = 9
    d.close([])                       # not inside begin()/end(): nothing
    assert words[X.INTENT_AT // 8] == 9 and d.on
    d.begin()
    assert words[X.INTENT_AT // 8] == 0
    words[X.INTENT_AT // 8] = 9
    d.close([])                       # no CUDA here: registration fails, the drain goes off
    assert not d.on and words[X.INTENT_AT // 8] == 0
    d.end()
    assert words[X.INTENT_AT // 8] == 0
