"""The exit notice (leto_run/exit_notice.py, leto_runtime/exit_notice.py) with real processes
and real signals: an abrupt death -- SIGKILL, `os._exit` -- is reported with the status the
kernel's waitpid then gives (the oracle: the reaped child's own return code); a clean exit, a
deliberate one after `disarm()`, and a process that never arms report nothing.

The exit fence, with the agent's GPU behaviour forced on this machine (`gpu=True`): a killed
trainer's fence reports "quiet" after "began" and only once every file of the process is
released (the oracle: a pipe whose write end the trainer opened *after* the fence -- at a
higher fd, as CUDA's device files are -- is at EOF by then); a fence the trainer closed early,
one it flagged (`check_fence` finding a device file below it), or a process that never armed
make it "untrusted"; a forked child holds the fence as it holds the device files, so the fence
is quiet only once the child is gone too."""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from leto_run.exit_notice import ExitNotices, fence_verdict
from leto_runtime.wire import contract as C

CHILD = r"""
import os, sys, time
import leto_runtime                      # arms the notice (under leto-run: the env var)
from leto_runtime import exit_notice
how = sys.argv[1]
print("armed" if exit_notice._page is not None else "unarmed", flush=True)
sys.stdin.readline()
if how == "exit3":
    os._exit(3)
if how == "raise":
    raise RuntimeError("a script error")
if how == "deliberate":
    exit_notice.disarm()
    os._exit(86)
if how == "sleep":
    time.sleep(600)
"""


def _run(notices: ExitNotices, how: str, arm: bool = True):
    fd, page = notices.page()
    env = dict(os.environ)
    if arm:
        env[C.LETO_EXIT_NOTICE_FD] = str(fd)
    p = subprocess.Popen([sys.executable, "-c", CHILD, how], env=env, pass_fds=(fd,),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    os.close(fd)
    notices.watch(p.pid, page)
    assert p.stdout.readline().strip() == ("armed" if arm else "unarmed")
    return p


def _notices_until(notices: ExitNotices, pid: int, settle_s: float) -> list:
    out, end = [], time.monotonic() + settle_s
    while time.monotonic() < end:
        out += [n for n in notices.drain() if n[0] == pid]
        time.sleep(0.02)
    return out


@pytest.fixture
def notices():
    n = ExitNotices(enabled=True)
    yield n
    n.close()


@pytest.mark.parametrize("how", ["kill", "exit3"])
def test_an_abrupt_death_is_reported_with_the_status_waitpid_gives(notices, how):
    p = _run(notices, "sleep" if how == "kill" else how)
    if how == "kill":
        os.kill(p.pid, signal.SIGKILL)
    else:
        p.stdin.write("go\n")
        p.stdin.flush()
    got = []
    end = time.monotonic() + 60
    while not got and time.monotonic() < end:
        got = [n for n in notices.drain() if n[0] == p.pid]
        time.sleep(0.005)
    rc = p.wait(timeout=60)
    assert rc == (-signal.SIGKILL if how == "kill" else 3)
    assert [(pid, code, kind) for pid, code, _, kind in got] == [(p.pid, rc, "began")], got


@pytest.mark.parametrize("how", ["clean", "raise", "deliberate", "unarmed"])
def test_a_clean_or_deliberate_exit_or_no_arming_reports_nothing(notices, how):
    p = _run(notices, "sleep" if how == "unarmed" else how, arm=how != "unarmed")
    if how == "unarmed":
        os.kill(p.pid, signal.SIGKILL)
    else:
        p.stdin.write("go\n")
        p.stdin.flush()
    rc = p.wait(timeout=60)
    assert rc == {"clean": 0, "raise": 1, "deliberate": 86, "unarmed": -9}[how]
    assert _notices_until(notices, p.pid, 1.5) == []
    notices.forget(p.pid)


FENCED = r"""
import os, sys, time
import leto_runtime                      # arms the notice and takes the fence
from leto_runtime import exit_notice
how = sys.argv[1]
late_w = int(sys.argv[2])
hi = os.dup(late_w)                      # "a device file": opened after the fence, above it
os.close(late_w)
if how == "flagged":
    exit_notice.check_fence(devices=sys.argv[3])
if how == "forked" and os.fork() == 0:
    time.sleep(600)                      # a data-loader-like child outliving its parent
    os._exit(0)
f = exit_notice._fence
holes = [] if f is None else [i for i in range(f) if not os.path.exists(f"/proc/self/fd/{i}")]
print(f"{f} {hi} {len(holes)}", flush=True)
if how == "closed":
    sys.stdin.readline()
    os.close(exit_notice._fence)
time.sleep(600)
"""


def _fenced(notices: ExitNotices, how: str, tmp_path):
    fd, page = notices.page()
    fence_r, fence_w = notices.fence()
    late_r, late_w = os.pipe()
    fake = tmp_path / "nvidia-fake"
    fake.write_text("")
    env = dict(os.environ, **{C.LETO_EXIT_NOTICE_FD: str(fd), C.LETO_EXIT_FENCE_FD: str(fence_w)})
    pre = ""
    if how == "flagged":                 # a device file below the fence: fd 0
        pre = f"import os; os.close(0); os.open({str(fake)!r}, os.O_RDONLY); "
    p = subprocess.Popen([sys.executable, "-c", pre + "exec(" + repr(FENCED) + ")", how,
                          str(late_w), str(fake)], env=env, pass_fds=(fd, fence_w, late_w),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    for x in (fd, fence_w, late_w):
        os.close(x)
    notices.watch(p.pid, page)
    first, hi, holes = p.stdout.readline().split()   # armed, and its files opened
    assert holes == "0"                  # the fence took the lowest free fd
    return p, fence_r, late_r, None if first == "None" else int(first), int(hi)


def _verdict(fence_r: int, pid: int, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if select.select([fence_r], [], [], 0.5)[0]:
            v = fence_verdict(fence_r, pid)
            if v is not None:
                return v, time.monotonic()
    return None, None


@pytest.mark.parametrize("how", ["plain", "forked", "closed", "flagged"])
def test_a_fence_is_quiet_only_after_every_later_file_of_the_dead_trainer(how, tmp_path):
    notices = ExitNotices(enabled=True, gpu=True)
    p, fence_r, late_r, fence_fd, hi = _fenced(notices, how, tmp_path)
    try:
        if how == "flagged":
            assert fence_fd is None          # flagged and dropped by check_fence
        else:
            assert hi > fence_fd             # below every file opened later
        if how == "closed":
            p.stdin.write("go\n")
            p.stdin.flush()
            assert _verdict(fence_r, p.pid)[0] == "untrusted"   # EOF while it lives
            return
        if how == "flagged":
            assert _verdict(fence_r, p.pid)[0] == "untrusted"   # the byte
            return
        assert not select.select([fence_r], [], [], 0.2)[0]     # nothing while it lives
        os.kill(p.pid, signal.SIGKILL)
        began, end = [], time.monotonic() + 60
        while not began and time.monotonic() < end:      # (not reaped before it is read)
            began = [n for n in notices.drain() if n[0] == p.pid]
            time.sleep(0.002)
        assert [n[3] for n in began] == ["began"], began
        if how == "forked":                  # its child holds the "device file" and the fence
            assert p.wait(timeout=60) == -signal.SIGKILL
            assert not select.select([fence_r], [], [], 1.0)[0]
            os.killpg(p.pid, signal.SIGKILL)
        verdict, when = _verdict(fence_r, p.pid)
        assert verdict == "quiet"
        # the oracle: the file opened after the fence was released before it
        assert select.select([late_r], [], [], 0)[0] and os.read(late_r, 1) == b""
        assert began[0][2] <= when
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        notices.close()
        os.close(late_r)
        os.close(fence_r)


def test_an_unarmed_trainer_closes_its_fence():
    notices = ExitNotices(enabled=True, gpu=True)
    fence_r, fence_w = notices.fence()
    env = dict(os.environ, **{C.LETO_EXIT_FENCE_FD: str(fence_w)})   # no notice page
    p = subprocess.Popen([sys.executable, "-c", "import leto_runtime, time; time.sleep(600)"],
                         env=env, pass_fds=(fence_w,))
    os.close(fence_w)
    try:
        assert _verdict(fence_r, p.pid)[0] == "untrusted"   # EOF while it lives
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
        os.close(fence_r)
        notices.close()
