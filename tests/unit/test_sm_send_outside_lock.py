"""The state manager sends replies without its pool lock (issue 16, item 9).

The real `Server` and `Pool` (memfd pages) run in this process, so the pool lock and the
fd duplicates in flight can be observed while a reply is stuck; clients are real sockets (and
one real process).  Every accepted connection gets a small kernel send buffer, so that a reply
of a few fd messages fills it -- with the default buffer the kernel takes ~70k fds first."""
from __future__ import annotations

import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from leto_run.state_manager.conns import Limits
from leto_run.state_manager.keeper import allow_record
from leto_run.state_manager.metadata import Geometry, PoolMeta
from leto_run.state_manager.pool import MemfdPages, Pool
from leto_run.state_manager.server import Server
from leto_runtime.wire import protocol as P

GEOM = Geometry(data_pages=8, tier1=4, tier2=1, page_bytes=4096)
PAGES = 3000                   # 12 messages of fds: far more than the small buffer holds


class SmallBuffers(Server):
    sndbuf = 4096

    def _admit(self, conn):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
        super()._admit(conn)


@pytest.fixture
def make(tmp_path):
    made = []

    def start(send_stall: float = 10.0):
        pool = Pool(PoolMeta(GEOM, GEOM.page_bytes), MemfdPages("device", sealed=False),
                    keeper=None, log=lambda m: None)
        logs: list[str] = []
        srv = SmallBuffers(pool, str(tmp_path / "sm.sock"), allow_file=str(tmp_path / "allow"),
                           parent_pid=os.getpid(), limits=Limits(send_stall=send_stall),
                           log=logs.append)
        t = threading.Thread(target=srv.serve, daemon=True)
        t.start()
        made.append((srv, t))
        return srv, logs

    yield start
    for srv, t in made:
        srv.request_stop()
        t.join(timeout=10)
        with srv.pool.lock:
            for name in list(srv.pool.meta.states):
                srv.pool.release(name)


def connect(srv) -> socket.socket:
    return P.connect(srv.path, deadline=time.monotonic() + 10)


def call(s, op, **args) -> tuple[dict, list[int]]:
    """One request; the reply and every fd it carried (read as they come)."""
    P.send_message(s, {"op": op, **args}, deadline=time.monotonic() + 10)
    got, header = [], None
    for header, fds, _ in P.iter_fd_train(s, deadline=time.monotonic() + 60, max_fds=1 << 20):
        got.extend(fds)
    return header, got


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stuck(srv, c) -> None:
    """`c` asks for the state's fds and never reads: the reply stops in the kernel buffer."""
    P.send_message(c, {"op": "attach", "name": "w"}, deadline=time.monotonic() + 10)
    wait_for(lambda: srv.replies.sending > 0 and readable(c), 30, "the reply to be stuck")
    time.sleep(0.2)                          # it stays stuck: nobody reads
    assert srv.replies.sending == 1 and srv.budget.inflight <= P.MAX_FDS_PER_MESSAGE


def stuck_with_duplicates(srv) -> socket.socket:
    """A connection whose reply is stuck at a message boundary: the kernel took none of the
    next message, so the server holds duplicates of its fds.  That needs a buffer that takes the
    first message whole but not the train; the kernel's accounting decides which sizes do, so
    sizes are tried (later messages are small: any stall after the first is at a boundary)."""
    for size in range(2048, 65536, 1024):
        srv.sndbuf = size
        c = connect(srv)
        stuck(srv, c)
        if srv.budget.inflight:
            return c
        c.close()                            # stuck inside a message: the server drops it
        wait_for(lambda: srv.replies.sending == 0, 30, "the dropped reply")
    raise AssertionError("no buffer size stopped the reply at a message boundary")


def readable(s) -> bool:
    p = select.poll()                        # not select(): these fds are above FD_SETSIZE
    p.register(s, select.POLLIN)
    return bool(p.poll(0))


def hung_up(s) -> bool:
    p = select.poll()
    p.register(s, select.POLLHUP)
    return any(ev & select.POLLHUP for _, ev in p.poll(0))


def test_a_stuck_reply_holds_no_lock_and_never_sends_other_memory(make):
    srv, logs = make()
    a, b = connect(srv), connect(srv)
    h, fds = call(a, "allocate", name="w", nbytes=PAGES * GEOM.page_bytes, tier="host",
                  kind="process")
    assert h["ok"] and len(fds) == PAGES
    P.close_fds(fds)
    stuck(srv, a)
    assert srv.pool.lock.acquire(timeout=5)  # the pool is free while the reply waits
    srv.pool.lock.release()
    t0 = time.monotonic()
    h, _ = call(b, "release", name="w")      # another client changes the pool meanwhile
    assert h["pages"] == PAGES and time.monotonic() - t0 < 5
    got = []
    with pytest.raises((P.Disconnected, P.TruncatedMessage)):
        for _, fds, _ in P.iter_fd_train(a, deadline=time.monotonic() + 30, max_fds=PAGES):
            got.extend(fds)
    # what did arrive is the state's memory as described (duplicates kept it alive); the
    # rest was not replaced by anything else: the reply ended
    assert 0 < len(got) < PAGES and len(got) % P.MAX_FDS_PER_MESSAGE == 0
    assert all(os.fstat(fd).st_size == GEOM.page_bytes for fd in got)
    P.close_fds(got)
    assert any("reply abandoned: page" in m for m in logs), logs
    wait_for(lambda: srv.budget.inflight == 0, 10, "the duplicates to be closed")
    assert srv.pool.fds == {}
    a.close(), b.close()


def test_a_client_that_stops_reading_is_dropped_and_others_are_served(make):
    srv, logs = make(send_stall=1.0)
    a, b = connect(srv), connect(srv)
    P.close_fds(call(a, "allocate", name="w", nbytes=PAGES * GEOM.page_bytes, tier="host",
                     kind="process")[1])
    stuck(srv, a)
    t0 = time.monotonic()
    h, fds = call(b, "attach", name="w")     # a whole train while the other one is stuck
    assert h["ok"] and len(fds) == PAGES and time.monotonic() - t0 < 5
    P.close_fds(fds)
    wait_for(lambda: hung_up(a), 30, "the stalled connection to be closed")
    wait_for(lambda: srv.budget.inflight == 0, 10, "its duplicates to be closed")
    assert any("reply not delivered" in m for m in logs), logs
    a.close(), b.close()


ATTACHER = r"""
import sys, time
from leto_runtime.wire import protocol as P
P.raise_nofile_limit()
s = P.connect(sys.argv[1], deadline=time.monotonic() + 10)
P.send_message(s, {"op": "attach", "name": "w"}, deadline=time.monotonic() + 10)
time.sleep(1.0)                        # its reply stops at a message boundary too, meanwhile
n = 0
for h, fds, _ in P.iter_fd_train(s, deadline=time.monotonic() + 60, max_fds=1 << 20):
    assert h["ok"], h
    n += len(fds)
    P.close_fds(fds)
print(n, flush=True)
"""


def test_near_the_fd_limit_a_reply_waits_for_the_duplicates_of_a_stuck_one(make, tmp_path):
    srv, logs = make(send_stall=2.0)
    a = connect(srv)
    P.close_fds(call(a, "allocate", name="w", nbytes=PAGES * GEOM.page_bytes, tier="host",
                     kind="process")[1])
    a.close()
    a = stuck_with_duplicates(srv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # room for the stuck reply's duplicates, but not for another message of fds beside them
    tight = len(srv.pool.fds) + srv.budget.reserve + srv.budget.inflight + 100
    assert len(os.listdir("/proc/self/fd")) < tight
    resource.setrlimit(resource.RLIMIT_NOFILE, (tight, hard))
    try:
        p = subprocess.Popen([sys.executable, "-c", ATTACHER, srv.path], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        (tmp_path / "allow").write_bytes(allow_record([p.pid]))
        out, err = p.communicate(timeout=120)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert p.returncode == 0 and int(out) == PAGES, err       # all of it, no fd_limit
    assert hung_up(a)                        # it waited for the stuck one's duplicates
    wait_for(lambda: srv.budget.inflight == 0, 10, "the duplicates to be closed")
    a.close()
