"""The agent's heartbeat socket accepts only well-formed datagrams from registered pids."""
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from leto_run.heartbeat import HeartbeatServer
from leto_runtime.wire import contract as C


@pytest.fixture
def server(tmp_path):
    s = HeartbeatServer(str(tmp_path / "hb.sock"))
    yield s
    s.close()


def send(path, payload: bytes):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    c.sendto(payload, path)
    c.close()


def beat(**kw):
    msg = {"v": C.HEARTBEAT_VERSION, "kind": "beat", "rank": 0, "role": "active", "gen": 0,
           "pid": 1, "step": 7}
    msg.update(kw)
    return json.dumps(msg).encode()


def test_socket_is_private(server):
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600


def test_accepts_registered_pid_using_kernel_credentials(server):
    send(server.path, beat(pid=999999))       # the payload's pid is ignored
    beats = server.drain({os.getpid()})
    assert len(beats) == 1 and beats[0].pid == os.getpid() and beats[0].step == 7


def test_rejects_unregistered_pid(server):
    send(server.path, beat())
    assert server.drain({os.getpid() + 1}) == [] and server.rejected == 1


@pytest.mark.parametrize("payload", [
    b"not json", b"[1,2]", beat(v=99), beat(kind="evil"), b"x" * (C.HEARTBEAT_MAX_BYTES + 10),
    json.dumps({"v": 1, "kind": "beat", "rank": "zero"}).encode(),
])
def test_rejects_malformed(server, payload):
    send(server.path, payload)
    assert server.drain({os.getpid()}) == []
    assert server.rejected == 1


def test_other_process_pid_is_what_counts(server):
    code = ("import socket,sys; c=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
            f"c.sendto({beat()!r}, sys.argv[1])")
    p = subprocess.run([sys.executable, "-c", code, server.path], timeout=30)
    assert p.returncode == 0
    assert server.drain({os.getpid()}) == []       # came from the child's pid, not ours


def test_a_sender_is_not_held_while_the_control_loop_does_not_drain(server):
    """The kernel queues only max_dgram_qlen (often 10) datagrams; a trainer's control datagram
    waits for room.  The reader thread empties the queue while the control loop is busy (no
    `drain()` here until the end), so 300 datagrams go out without waiting long, the selector
    fd says so, and `drain()` returns them all, in the order they were sent."""
    import select
    import time

    c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    c.setblocking(False)
    deadline = time.monotonic() + 20
    for step in range(300):
        while True:
            try:
                c.sendto(beat(step=step), server.path)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"datagram {step} waited 20 s for room"
                time.sleep(0.001)
    c.close()
    assert select.select([server.fileno()], [], [], 5.0)[0], "the selector was not woken"
    got = []
    while len(got) < 300 and time.monotonic() < deadline:
        got += server.drain({os.getpid()})
        time.sleep(0.01)
    assert [b.step for b in got] == list(range(300))
    assert server.rejected == 0 and server.dropped == 0


def test_a_datagram_carries_when_it_was_sent_if_that_is_plausible(server):
    """`t`: the sender's CLOCK_MONOTONIC (the report times detection from an injection's send,
    which the death it causes may overtake at the agent).  A time after the arrival, long
    before it, or not a number is ignored: the arrival time stands."""
    import time
    sent = time.monotonic()
    for t in (sent, sent + 3600.0, sent - 3600.0, "soon"):
        send(server.path, beat(kind="inject", detail="kill:rank=0:step=7", t=t))
    got = server.drain({os.getpid()})
    assert [b.sent for b in got] == [sent, None, None, None]
    assert all(b.mono >= sent for b in got)


SENDER = """
import signal, sys, types
from leto_runtime import beats as B
ctx = types.SimpleNamespace(under_leto=True, heartbeat_socket=sys.argv[1], inject_plan=[],
                            dump_signal=signal.SIGUSR1, rank=0, role="active", generation=0)
B.Channel(ctx).send("inject", 7, "kill:rank=0:step=7")
"""


def test_the_runtime_stamps_each_datagram_with_its_send_time(server):
    """The sender side (leto_runtime.beats.Channel), in a real process of its own."""
    import time
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", SENDER, server.path], cwd=str(Path(__file__).parents[2]))
    assert p.wait(timeout=60) == 0
    [b] = server.drain({p.pid})
    assert b.kind == "inject" and b.sent is not None and t0 <= b.sent <= b.mono
