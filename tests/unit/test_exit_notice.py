"""The exit notice (leto_run/exit_notice.py, leto_runtime/exit_notice.py) with real processes
and real signals: an abrupt death -- SIGKILL, `os._exit` -- is reported with the status the
kernel's waitpid then gives (the oracle: the reaped child's own return code); a clean exit, a
deliberate one after `disarm()`, and a process that never arms report nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from leto_run.exit_notice import ExitNotices
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
    assert [(pid, code) for pid, code, _ in got] == [(p.pid, rc)], got


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
