"""RMP wire protocol over socketpairs: framing, fd passing and trains, typed errors, limits."""
from __future__ import annotations

import array
import json
import os
import socket
import stat
import struct
import time

import pytest

from leto_runtime.wire import protocol as P


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def soon(s=5.0):
    return time.monotonic() + s


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def raw(sock, body: bytes, fds=()):
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([struct.pack(">I", len(body)) + body], anc)


def test_roundtrip_with_fds_sharing_the_file(pair):
    a, b = pair
    r, w = os.pipe()
    P.send_message(a, {"op": "x", "n": [1, 2]}, [w], deadline=soon())
    m = P.recv_message(b, deadline=soon(), max_fds=1)
    assert m.header == {"op": "x", "n": [1, 2], "v": P.VERSION, "nfds": 1} and len(m.fds) == 1
    os.write(m.fds[0], b"hi")                           # the received fd is the same pipe
    assert os.read(r, 2) == b"hi"
    assert os.get_inheritable(m.fds[0]) is False         # MSG_CMSG_CLOEXEC
    P.close_fds([r, w, *m.fds])


def test_fd_train_of_600(pair):
    a, b = pair
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(600)]
    before = open_fds()
    P.send_fd_train(a, {"op": "t"}, fds, deadline=soon())
    P.close_fds(fds)
    batches = []
    for h, got, off in P.iter_fd_train(b, deadline=soon(), max_fds=600):
        assert len(got) <= P.MAX_FDS_PER_MESSAGE and h["op"] == "t"
        batches.append((off, len(got)))
        P.close_fds(got)
    assert batches == [(0, 253), (253, 253), (506, 94)]
    assert open_fds() == before - 600
    with pytest.raises(P.BadFds):
        P.send_message(a, {}, fds[:254], deadline=soon())


def test_recv_fd_train_bounds(pair):
    a, b = pair
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(300)]
    P.send_fd_train(a, {"op": "t"}, fds, deadline=soon())
    before = open_fds()
    with pytest.raises(P.BadFds) as ei:
        P.recv_fd_train(b, deadline=soon(), max_fds=299)
    assert ei.value.desync and open_fds() == before     # refused fds were closed
    P.close_fds(fds)


def test_oversized_is_refused_from_the_length(pair):
    a, b = pair
    a.sendall(struct.pack(">I", P.MAX_MESSAGE + 1))
    with pytest.raises(P.MessageTooLarge) as ei:
        P.recv_message(b, deadline=soon())
    assert ei.value.desync and ei.value.code is P.ErrorCode.TOO_LARGE
    with pytest.raises(P.MessageTooLarge):
        P.send_message(a, {"x": "y" * P.MAX_MESSAGE}, deadline=soon())


def test_truncated_and_timeouts(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 100) + b'{"v":1')
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(P.TruncatedMessage):
        P.recv_message(b, deadline=soon())
    c, d = socket.socketpair()
    t0 = time.monotonic()
    with pytest.raises(P.RmpTimeout):
        P.recv_message(d, deadline=soon(0.2))
    assert time.monotonic() - t0 < 2
    c.sendall(struct.pack(">I", 100) + b"{")             # started, then stalls
    with pytest.raises(P.TruncatedMessage):
        P.recv_message(d, deadline=soon(0.2))
    c.close()
    with pytest.raises(P.Disconnected):                  # clean EOF between messages
        P.recv_message(d, deadline=soon(0.2))
    d.close()


@pytest.mark.parametrize("body, err", [
    (b"\xff\xfe", P.BadMessage), (b"not json", P.BadMessage), (b"[1]", P.BadMessage),
    (b'{"v": 99, "nfds": 0}', P.BadVersion), (b'{"nfds": 0}', P.BadVersion),
])
def test_bad_bodies_keep_the_stream(pair, body, err):
    a, b = pair
    raw(a, body)
    with pytest.raises(err) as ei:
        P.recv_message(b, deadline=soon())
    assert not ei.value.desync
    P.send_message(a, {"ok": True}, deadline=soon())
    assert P.recv_message(b, deadline=soon()).header["ok"] is True


def test_fd_count_mismatch_closes_what_arrived(pair):
    a, b = pair
    r, w = os.pipe()
    before = open_fds()
    raw(a, json.dumps({"v": P.VERSION, "nfds": 0}).encode(), [r, w])
    with pytest.raises(P.BadFds):
        P.recv_message(b, deadline=soon(), max_fds=0)
    raw(a, json.dumps({"v": P.VERSION, "nfds": 3}).encode(), [r])
    with pytest.raises(P.BadFds):
        P.recv_message(b, deadline=soon(), max_fds=8)
    assert open_fds() == before
    P.close_fds([r, w])


def test_error_replies_map_to_classes():
    for cls in (P.UnknownName, P.SizeMismatch, P.NotAuthorized, P.FdLimit, P.BadFds):
        with pytest.raises(cls) as ei:
            P.raise_for_reply(P.error_reply(cls("m", {"k": 1})))
        assert ei.value.message == "m" and ei.value.details == {"k": 1}
    with pytest.raises(P.InternalError):
        P.raise_for_reply({"ok": False, "error": {"code": "martian"}})
    with pytest.raises(P.BadMessage):
        P.raise_for_reply({"what": 1})
    assert P.raise_for_reply({"ok": True, "x": 1})["x"] == 1


def test_arg_checks():
    h = {"n": 3, "b": True, "s": "x", "none": None}
    assert P.arg(h, "n", int) == 3
    with pytest.raises(P.BadArgument):
        P.arg(h, "b", int)                               # a bool is not a count
    with pytest.raises(P.BadArgument):
        P.arg(h, "n", int, check=lambda v: v > 5)
    with pytest.raises(P.BadArgument):
        P.arg(h, "missing", int)
    assert P.arg(h, "missing", int, default=7) == 7 and P.arg(h, "none", str, default="d") == "d"


def test_bind_private_is_0600(tmp_path):
    path = str(tmp_path / "s.sock")
    s = P.bind_private(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    c = P.connect(path, deadline=soon())
    conn, _ = s.accept()
    cred = P.peer_cred(conn)
    assert (cred.pid, cred.uid) == (os.getpid(), os.geteuid())
    for x in (c, conn, s):
        x.close()
    with pytest.raises(P.Disconnected):
        P.connect(str(tmp_path / "none.sock"), deadline=soon(0.1))


def test_idle_wait_works_for_fds_above_fd_setsize():
    """A busy state manager holds thousands of page fds: its connections get fd numbers above
    select()'s 1024 limit (regression: 'filedescriptor out of range in select()')."""
    import os
    import socket as _socket

    from leto_runtime.wire import protocol as PP
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        assert b.fileno() > 1024
        import time
        PP.send_message(a, {"op": "hello", "id": 1}, deadline=time.monotonic() + 5)
        msg = PP.recv_message(b, deadline=None, idle_check=lambda: False)
        assert msg.header["op"] == "hello"
        a.close()
        b.close()
    finally:
        for fd in filler:
            os.close(fd)
