"""Limits of the RMP wire protocol and of the state manager's admission (issue 16, item 9).

Headers past the JSON limits are a `BadMessage` that keeps the stream in sync; a closed or
refused connection is told apart from one whose request ran; the admission decisions and the
O(1) size plan agree with what the pool would really do."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from leto_run.state_manager.budget import Need, allocation_need, memory_refusal
from leto_run.state_manager.conns import ConnTable, Limits, limits_from_env, refusal
from leto_run.state_manager.metadata import Geometry, PoolMeta
from leto_runtime.wire import header as H
from leto_runtime.wire import protocol as P


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def soon(s=5.0):
    return time.monotonic() + s


def nest(k: int, inner: str = "1") -> str:
    return "[" * k + inner + "]" * k


def mixed(k: int) -> str:
    out = inner = ""
    for i in range(k):
        out += "[" if i % 2 else '{"a":'
        inner = ("]" if i % 2 else "}") + inner
    return out + "1" + inner


BAD = [
    nest(100_000), '{"a":' * 100_000 + "1" + "}" * 100_000,      # the parser's RecursionError
    nest(H.MAX_DEPTH + 1), mixed(H.MAX_DEPTH + 1), mixed(2 * H.MAX_DEPTH),
    '{"s": "' + "]" * 60 + '", "x": ' + nest(H.MAX_DEPTH + 1) + "}",   # brackets in strings
    "[1" + "0" * 5000 + "]",                                     # int() refuses > 4300 digits
    f"[{2 ** 63}]", f"[{-2 ** 63 - 1}]", f'{{"n": {10 ** 30}}}',
    "[NaN]", "[Infinity]", "[-Infinity]", "[1e999]", "[-1e400]",
]
GOOD = [nest(H.MAX_DEPTH), mixed(H.MAX_DEPTH), f"[{2 ** 63 - 1}, {-2 ** 63}]",
        '{"s": "' + "[" * 200 + '"}', '{"s": "' + "9" * 40 + '"}', "[1.5e300, -0.0]"]


@pytest.mark.parametrize("body", BAD, ids=lambda b: b[:24])
def test_headers_past_the_limits_are_bad_messages_and_keep_the_stream(pair, body):
    a, b = pair
    raw = body.encode()
    t = threading.Thread(target=a.sendall, args=(struct.pack(">I", len(raw)) + raw,))
    t.start()                                   # larger than the socket buffer
    with pytest.raises(P.BadMessage) as ei:
        P.recv_message(b, deadline=soon())
    t.join(timeout=30)
    assert not ei.value.desync
    P.send_message(a, {"after": 1}, deadline=soon())            # the stream is still in sync
    assert P.recv_message(b, deadline=soon()).header["after"] == 1


@pytest.mark.parametrize("body", GOOD, ids=lambda b: b[:24])
def test_headers_within_the_limits_parse_as_json_does(body):
    assert H.loads(body.encode()) == json.loads(body)


def test_closing_and_not_sent_mean_the_request_never_ran(pair):
    a, b = pair
    with pytest.raises(P.Closing) as ei:
        P.raise_for_reply(P.error_reply(P.Closing("idle", {"reason": "idle"})))
    assert isinstance(ei.value, P.NotProcessed) and isinstance(ei.value, P.Disconnected)
    assert ei.value.code.value == "closing"
    assert not P.peer_closed(a)                                  # idle and open
    P.send_message(b, P.error_reply(P.Closing("bye")), deadline=soon())
    assert P.peer_closed(a)                                      # a goodbye waits: reconnect
    b.close()
    with pytest.raises(P.NotSent):
        P.send_message(a, {"op": "allocate"}, deadline=soon())
    assert issubclass(P.NotSent, P.NotProcessed)


def test_admission_decisions():
    lim = Limits(max_conns=4, max_per_pid=2, max_pending=3)
    assert refusal(lim, pending=False, total=0, of_pid=0, waiting=3) is None   # pending never block
    assert "per process" in refusal(lim, pending=False, total=2, of_pid=2, waiting=0)
    assert "at most 4" in refusal(lim, pending=False, total=4, of_pid=0, waiting=0)
    assert "unregistered" in refusal(lim, pending=True, total=4, of_pid=0, waiting=3)
    t = ConnTable(lim)
    assert [t.take_pending() for _ in range(4)][3] is not None
    assert t.take_auth(10) is None and t.take_auth(10) is None and t.take_auth(10)
    assert t.take_auth(11, from_pending=True) is None           # left its pending slot
    assert t.stats() == {"authenticated": 3, "pending": 2, "pids": 2}
    t.leave(10, True), t.leave(11, True), t.leave(0, False)
    assert t.stats() == {"authenticated": 1, "pending": 1, "pids": 1}


@pytest.mark.parametrize("raw, want, warn", [
    (None, 300.0, False), ("", 300.0, False), ("12.5", 12.5, False), ("0", 300.0, True),
    ("-3", 300.0, True), ("inf", 300.0, True), ("nan", 300.0, True), ("abc", 300.0, True),
    ("1e9", 300.0, True)])
def test_idle_timeout_from_the_environment(raw, want, warn):
    lim, why = limits_from_env({} if raw is None else {"LETO_SM_IDLE_TIMEOUT": raw})
    assert lim.idle_timeout == want and bool(why) == warn
    if warn:
        assert "LETO_SM_IDLE_TIMEOUT" in why and "using 300" in why


@pytest.mark.parametrize("nbytes", [1, 4096, 65536, 65537, 8 * 65536, 8 * 65536 + 1, 10 ** 7])
@pytest.mark.parametrize("tier, protected", [("device", True), ("host", False), ("host", True)])
def test_page_counts_match_the_plan(nbytes, tier, protected):
    meta = PoolMeta(Geometry(data_pages=8, tier1=4, tier2=1, page_bytes=64 << 10), 128 << 10)
    data, parity = meta.page_counts(nbytes, tier, protected)
    st = meta.plan_state("s", nbytes, "model", protected, tier, None, None)
    assert (data, parity) == (len(st.data), sum(len(g.p1) + len(g.p2) for g in st.groups))
    need = allocation_need(meta, nbytes, tier, protected, "cuda")
    assert need.fds == data + parity
    assert need.device_bytes == (data * st.page_bytes if tier == "device" else 0)


def test_memory_refusal():
    need = Need(fds=10, host_bytes=3 << 30, device_bytes=0)
    assert memory_refusal(1, need, (4 << 30, "MemAvailable"), None) is None
    why = memory_refusal(5, need, (2 << 30, "MemAvailable"), None)
    assert "3.00 GiB of host memory" in why and "2.00 GiB" in why and "MemAvailable" in why
    assert memory_refusal(5, need, None, None) is None                 # unknown: the pool decides
    dev = Need(fds=1, host_bytes=0, device_bytes=100 << 30)
    assert "device memory" in memory_refusal(5, dev, (1, "x"), (80 << 30, "GPU 0"))


def test_changes_and_marks_are_the_same_whichever_walk_is_cheaper():
    meta = PoolMeta(Geometry(data_pages=4, tier1=2, tier2=1, page_bytes=4096), 4096)
    for name, n in (("a", 3), ("b", 40)):
        meta.add_state(meta.plan_state(name, n * 4096, "model", True, "device", None, None))
    b = meta.states["b"]
    v0 = meta.version
    meta.touch(b.data[5:30])                    # more history than "a" has pages
    for pid in b.data[:20]:
        meta.flag(pid).failed = True
    assert sorted(meta.changed_since(b, v0)) == b.data[5:30]
    assert meta.changed_since(meta.states["a"], v0) == []
    assert meta.marks(b)["data"] == list(range(20)) and meta.marks(meta.states["a"])["data"] == []


@pytest.mark.parametrize("raw, want, warn", [(None, 10.0, False), ("3", 3.0, False),
                                             ("0", 10.0, True), ("soon", 10.0, True)])
def test_the_send_stall_comes_from_its_knob(raw, want, warn):
    lim, why = limits_from_env({} if raw is None else {"LETO_SM_SEND_STALL": raw})
    assert lim.send_stall == want and lim.idle_timeout == Limits().idle_timeout
    assert bool(why) == warn and (not warn or ("LETO_SM_SEND_STALL" in why and "using 10" in why))
