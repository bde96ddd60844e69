"""A SIGKILL of the launcher leaves no run directory in $TMPDIR and no process (issue 16,
item 11): the guardian, told the directory with `own_dir`, removes it once the processes it
killed are gone.  After a clean `release()` it removes nothing (the agent cleans up itself).

The first two tests drive the guardian directly from a real owner process that is SIGKILLed;
the last one does the same to a real `leto-run` (its agent calls `own_dir` on its run dir)."""
from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import textwrap
import time

from leto_testing import ROOT, SCRIPTS, base_env, leto_cmd, pid_alive, with_env

# The owner: a guardian, a directory it owns (with a socket file in it, as the agent's run
# directory has), and a child process group announced to it.
OWNER = textwrap.dedent("""
    import os, socket, subprocess, sys, tempfile, time
    from leto_run.guardian import start_guardian
    g = start_guardian("LETO_TEST_GUARDIAN_TOKEN=" + sys.argv[1])
    d = tempfile.mkdtemp(prefix="leto-")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(d, "hb.sock"))
    open(os.path.join(d, "allow_0"), "w").write("1")
    g.own_dir(d)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             process_group=0)
    g.announce(child.pid)
    print(d, child.pid, g.pid, flush=True)
    if sys.argv[2] == "release":
        g.release()
        print("released", flush=True)
    time.sleep(300)
""")


def wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def start_owner(tmp_path, mode: str):
    env = base_env(TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", OWNER, "tok", mode], env=env, cwd=str(ROOT),
                         stdout=subprocess.PIPE, text=True)
    d, child, guardian = p.stdout.readline().split()
    return p, d, int(child), int(guardian)


def test_guardian_removes_owned_dir_after_sigkill_of_owner(tmp_path):
    p, d, child, guardian = start_owner(tmp_path, "kill")
    try:
        assert os.path.isdir(d) and os.path.exists(os.path.join(d, "hb.sock"))
        # `ps` tells it from its owner (a fork, it had the owner's command line)
        title = f"leto_run.guardian\0(of the leto-run agent {p.pid})".encode()
        assert wait_for(lambda: open(f"/proc/{guardian}/cmdline", "rb").read().startswith(title), 10)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        assert wait_for(lambda: not os.path.exists(d), 20), os.listdir(d)
        assert wait_for(lambda: not pid_alive(child) and not pid_alive(guardian), 20)
        assert os.listdir(tmp_path) == []
    finally:
        p.kill()
        for pid in (child, guardian):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_guardian_after_release_removes_and_kills_nothing(tmp_path):
    p, d, child, guardian = start_owner(tmp_path, "release")
    try:
        assert p.stdout.readline().strip() == "released"
        assert wait_for(lambda: not pid_alive(guardian), 20)      # exited on "done"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        time.sleep(0.5)
        assert os.path.isdir(d) and pid_alive(child)
    finally:
        p.kill()
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_sigkill_of_leto_run_leaves_no_run_dir_and_no_process(tmp_path, out_dir):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = base_env(out_dir, TMPDIR=str(tmp))
    p = subprocess.Popen(leto_cmd("--no-status", "--nproc-per-node", "2",
                                  str(SCRIPTS / "tree.py")), env=env, cwd=str(ROOT),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        assert wait_for(lambda: all((out_dir / f"pids_{r}").exists() for r in (0, 1)), 90)
        for r in (0, 1):
            pids += [int(x) for x in (out_dir / f"pids_{r}").read_text().split()]
        [run_dir] = [tmp / n for n in os.listdir(tmp) if n.startswith("leto-")]
        assert (os.stat(run_dir).st_mode & 0o777) == 0o700
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        assert wait_for(lambda: not run_dir.exists(), 30), os.listdir(run_dir)
        assert wait_for(lambda: not any(pid_alive(x) for x in pids), 30)
        assert wait_for(lambda: not with_env(f"OUT_DIR={out_dir}"), 30), with_env(
            f"OUT_DIR={out_dir}")
        # Only torch's own stay: the per-rank logs (torchrun keeps them too) and the per-user
        # compile cache that `import torch._dynamo` makes (the fork server preloads it; any
        # script that builds a torch optimizer under torchrun makes it as well).
        assert all(n.startswith("torchelastic_") or n == f"torchinductor_{getpass.getuser()}"
                   for n in os.listdir(tmp)), os.listdir(tmp)
    finally:
        p.kill()
        for x in pids:
            if pid_alive(x):
                os.kill(x, signal.SIGKILL)
