"""fd limits: every retained page is one fd in the state manager and one in the agent's keeper
(one keeper per rank slot, all in the agent process).  The soft RLIMIT_NOFILE is raised to the
hard one; beyond the hard limit the error is typed (`fd_limit`) and names the fix."""
from __future__ import annotations

import json
import subprocess
import sys

from leto_run.state_manager.keeper import FdKeeper, fds_held_by_keepers
from leto_runtime.wire import protocol as P


def test_soft_limit_raised_and_hard_limit_error_names_the_fix():
    code = r"""
import resource
from leto_runtime.wire import protocol as P
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 900))
soft, hard = P.check_nofile(800, "the state manager")
assert (soft, hard) == (900, 900), (soft, hard)
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (900, 900)
try:
    P.check_nofile(5000, "the state manager")
except P.FdLimit as e:
    assert e.code.value == "fd_limit" and e.details == {"need": 5000, "soft": 900, "hard": 900,
                                                        P.BEYOND_HARD_LIMIT: True}
    print(e.message)
else:
    raise SystemExit("no FdLimit")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    msg = r.stdout
    assert "the state manager needs about 5000 open files" in msg and "is 900" in msg
    assert "ulimit -Hn 5000" in msg and "--ulimit nofile=5000:5000" in msg
    assert "LimitNOFILE=5000" in msg and "page_bytes" in msg


# A state manager's side of two keepers (a child of this process, as the keepers require):
# b's capacity, then 100 fds put into a, then b's capacity and limits again, as b reports them.
KEEPER_CLIENT = r"""
import json, os, sys
from leto_run.state_manager.keeper import KeeperLink
a, b = KeeperLink(sys.argv[1]), KeeperLink(sys.argv[2])
b.hello(max_fds=0)
cap0 = b.capacity
a.hello(max_fds=0)
a.commit({pid: os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for pid in range(1, 101)}, [], {})
b.hello(max_fds=0)
print(json.dumps({"cap0": cap0, "cap1": b.capacity, "limits": b.limits}))
"""


def test_keepers_of_one_process_share_the_limit(tmp_path):
    a = FdKeeper(str(tmp_path), 0, log=lambda m: None)
    b = FdKeeper(str(tmp_path), 1, log=lambda m: None)
    try:
        held0 = fds_held_by_keepers()
        r = subprocess.run([sys.executable, "-c", KEEPER_CLIENT, a.path, b.path],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        seen = json.loads(r.stdout)
        assert fds_held_by_keepers() == held0 + 100
        assert seen["cap1"] == seen["cap0"] - 100      # a's fds count against b's room too
        lim = seen["limits"]
        assert lim["held_total"] == held0 + 100 and lim["keepers"] >= 2
    finally:
        a.close()
        b.close()
    assert fds_held_by_keepers() == held0


def test_keeper_link_error_names_the_fix():
    from leto_run.state_manager.keeper import KeeperLink

    link = KeeperLink.__new__(KeeperLink)
    link.capacity = 10
    link.limits = {"held_total": 19000, "keepers": 8, "nofile": [20000, 20000]}
    try:
        link.commit({i: -1 for i in range(1, 501)}, [], {})
    except P.FdLimit as e:
        assert "can take 10 more fds, 500 needed" in e.message
        assert "the agent (fd keepers of every rank slot of this node)" in e.message
        assert "ulimit -Hn" in e.message and e.details["hard"] == 20000
    else:
        raise AssertionError("no FdLimit")
