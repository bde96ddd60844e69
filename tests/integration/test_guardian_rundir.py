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

from leto_testing import ROOT, SCRIPTS, base_env, events, leto_cmd, pid_alive, with_env

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


# The owner of a guardian that stops reading: SIGSTOPped, then told more than its pipe holds.
OWNER_STOPPED = textwrap.dedent("""
    import os, signal, subprocess, sys, tempfile, time
    from leto_run.guardian import start_guardian
    g = start_guardian("LETO_TEST_GUARDIAN_TOKEN=" + sys.argv[1])
    d = tempfile.mkdtemp(prefix="leto-")
    g.own_dir(d)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             process_group=0)
    os.kill(g.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    for _ in range(20000):               # ~240 KB of lines: a pipe holds 64 KiB
        g.announce(child.pid)
    said = time.monotonic() - t0
    g.release()
    print(d, child.pid, g.pid, f"{said:.3f}", f"{time.monotonic() - t0:.3f}", flush=True)
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


def _tree_started(out_dir, tmp, pids: list[int]):
    """Once both ranks of tree.py wrote their process trees: their pids added to `pids`, and
    the job's run directory in `tmp`."""
    assert wait_for(lambda: all((out_dir / f"pids_{r}").exists() for r in (0, 1)), 90)
    for r in (0, 1):
        pids += [int(x) for x in (out_dir / f"pids_{r}").read_text().split()]
    [run_dir] = [tmp / n for n in os.listdir(tmp) if n.startswith("leto-")]
    return run_dir


def test_sigkill_of_leto_run_leaves_no_run_dir_and_no_process(tmp_path, out_dir):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = base_env(out_dir, TMPDIR=str(tmp))
    p = subprocess.Popen(leto_cmd("--no-status", "--nproc-per-node", "2",
                                  str(SCRIPTS / "tree.py")), env=env, cwd=str(ROOT),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        run_dir = _tree_started(out_dir, tmp, pids)
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


def _new_guardian(agent: int, old: int, timeout: float) -> int | None:
    """The one guardian of `agent` other than `old`, read in one pass once it is there (its
    title is written while it starts: two reads may disagree), or None after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = guardians_of(agent)
        if old not in found and len(found) == 1:
            return found[0]
        time.sleep(0.05)
    return None


def guardians_of(agent: int) -> list[int]:
    """The agent's children that call themselves its guardian (leto_run.guardian._retitle)."""
    found = []
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            with open(f"/proc/{e.name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{e.name}/cmdline", "rb") as f:
                title = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and title.startswith(b"leto_run.guardian\0") and pid_alive(int(e.name)):
            found.append(int(e.name))
    return found


def test_a_killed_guardian_is_replaced_so_a_later_sigkill_of_leto_run_still_cleans_up(
        tmp_path, out_dir):
    """The agent watches its guardian (a pidfd in its selector): a SIGKILLed guardian is
    noticed, logged and started again with everything the old one knew (the run directory,
    every process group), so a SIGKILL of leto-run after it still leaves nothing behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = base_env(out_dir, TMPDIR=str(tmp))
    ev = tmp_path / "ev.jsonl"
    p = subprocess.Popen(leto_cmd("--no-status", "--nproc-per-node", "2", "--events", str(ev),
                                  str(SCRIPTS / "tree.py")), env=env, cwd=str(ROOT),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        run_dir = _tree_started(out_dir, tmp, pids)
        [old] = guardians_of(p.pid)
        os.kill(old, signal.SIGKILL)
        new = _new_guardian(p.pid, old, 20)
        assert new is not None, "no new guardian"
        assert wait_for(lambda: any(e.get("event") == "guardian" and e.get("pid") == new
                                    for e in events(ev)), 10)
        [said] = [e for e in events(ev) if e["event"] == "guardian"]
        assert said["old_pid"] == old and said["action"] == "restarted", said
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        assert "guardian" in p.stderr.read()
        assert wait_for(lambda: not run_dir.exists(), 30), os.listdir(run_dir)
        assert wait_for(lambda: not any(pid_alive(x) for x in pids), 30)
        assert wait_for(lambda: not with_env(f"OUT_DIR={out_dir}"), 30), with_env(
            f"OUT_DIR={out_dir}")
    finally:
        p.kill()
        for x in pids + guardians_of(p.pid):
            if pid_alive(x):
                os.kill(x, signal.SIGKILL)


def test_a_guardian_that_stops_reading_blocks_neither_the_agent_nor_its_exit(tmp_path):
    """The agent's pipe to a stopped guardian fills: what it says waits in the agent instead of
    blocking it, and the clean release, which the guardian cannot take, kills it (bounded),
    so that it never takes the closed pipe for a kill -9 of the agent and cleans up."""
    env = base_env(TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", OWNER_STOPPED, "tok"], env=env, cwd=str(ROOT),
                         stdout=subprocess.PIPE, text=True)
    child = guardian = 0
    try:
        d, child, guardian, said, released = p.stdout.readline().split()
        child, guardian = int(child), int(guardian)
        assert float(said) < 5.0 and float(released) < 10.0, (said, released)
        assert wait_for(lambda: not pid_alive(guardian), 10)
        time.sleep(0.5)
        assert os.path.isdir(d) and pid_alive(child)      # it cleaned nothing up
    finally:
        p.kill()
        for pid in (child, guardian):
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
