"""The checkpoint handshake when the job's store misbehaves (`ckpt_handshake`, `ckpt_writer`,
`ckpt_snapshot`): a request whose send timed out but arrived later; a claim carried out whose
answer was lost; a store that hangs (SIGSTOP); a trainer that could not read its claim and a
script that catches the exception; a shadow whose write report never comes.

The faults are real: a TCPStore server in a process of its own, and a TCP proxy between a
client and it that holds or severs a connection at the bytes of one request
(`tests/store_faults.py`).  The property every test checks is the one exactness needs: the
shadow's copy counts only when it was claimed before the trainer's update, and neither side
hangs on the store or loses step with the other's request numbers."""
from __future__ import annotations

import os
import threading
import time

import pytest

from leto_runtime import ckpt_handshake as H
from leto_runtime import ckpt_writer as W
from leto_runtime import runtime
from leto_runtime.wire.ckpt_files import Settings
from store_faults import StoreProxy, StoreServer
from store_faults import connect as _connect


@pytest.fixture
def server():
    s = StoreServer()
    try:
        yield s
    finally:
        s.cont() if s.proc.poll() is None else None
        s.kill()


@pytest.fixture
def fast_bounds(monkeypatch):
    monkeypatch.setattr(H, "CALL_S", 1.0)
    monkeypatch.setattr(H, "SETTLE_S", 3.0)


@pytest.fixture
def cleanup():
    yield
    runtime.current().forget_job()


def _shadow_takes(shadow: H.Handshake, n: int, out: list) -> None:
    """What a serving shadow does with request n: a void moves on; else it claims "ok"."""
    req = shadow.next_request(0, n, 20.0)
    out.append("void" if req is not None and "void" in req else
               None if req is None else shadow.answer(0, n, H.SHADOW_OK))


def _until_the_held_request_landed(port: int, key: str, bound_s: float = 60.0) -> None:
    """The proxy lets the held request through after its hold; on a busy machine its 7 MiB
    land a while later.  Watched through a connection of our own: the trainer's void is
    small, the request is not."""
    direct, end = _connect(port), time.monotonic() + bound_s
    while not (direct.check([key]) and len(direct.get(key)) > (1 << 20)):
        assert time.monotonic() < end, f"the held request never reached the store ({key})"
        time.sleep(0.05)


def test_a_request_sent_late_is_claimed_by_the_trainer_and_numbers_stay_in_step(
        monkeypatch, cleanup, server, fast_bounds):
    """The request's send outlives its bound (the proxy holds the connection), so `ask` cannot
    know it arrived -- it does arrive, later.  The trainer must claim it at its update without
    waiting (a shadow copying it then would read states being updated), void it, and the next
    request must reach the shadow under the next number and count."""
    from test_ckpt_snapshot_edges import _job
    job = _job(monkeypatch)
    proxy = StoreProxy(server.port)
    peer = W.ShadowPeer(H.Handshake(lambda: _connect(proxy.port), 1, 0))
    shadow = H.Handshake(lambda: _connect(server.port), 1, 0)
    shadow.serve(0, os.getpid())
    # The hold outlasts `ask`'s bound (CALL_S, 1 s) by far, also on a busy machine.
    hold_s = 8.0
    proxy.hold(b"/n0/req", hold_s)
    t0 = time.monotonic()
    small = peer.ask(job, 2, "x" * (7 << 20))       # large: the held connection blocks it
    assert small is not None and peer.unsent and time.monotonic() - t0 < hold_s
    # On a busy machine the proxy may see the request's key only after `ask` gave up on it:
    # either way the request is held and arrives late.
    end = time.monotonic() + 30.0
    while proxy.fired != ["hold"]:
        assert time.monotonic() < end, f"the proxy never held the request: {proxy.fired}"
        time.sleep(0.01)
    took: list = []
    th = threading.Thread(target=_shadow_takes, args=(shadow, 0, took))
    th.start()
    verdict, waited = peer.settle(timeout=30.0)      # claims at once: the request may be lost
    assert verdict == H.TRAINER and waited < hold_s + H.SETTLE_S, (verdict, waited)
    th.join(30)
    assert took in (["void"], [False]), took         # the shadow's late copy never counts
    assert peer.dead == set()                        # the shadow stays in use ...
    _until_the_held_request_landed(server.port, H.base(1, 0, 0, 0) + "/req")
    small = peer.ask(job, 3, "next")
    assert small is not None and not peer.unsent and peer.asked[1] == 1
    th = threading.Thread(target=_shadow_takes, args=(shadow, 1, took))
    th.start()
    th.join(30)
    assert took[-1] is True
    assert peer.settle(timeout=10.0)[0] == H.SHADOW_OK   # ... and its next copy counts
    proxy.close()


def test_a_claim_whose_answer_was_lost_is_read_again(server, fast_bounds):
    """The shadow's "ok" reaches the store and the answer is lost (the proxy severs the
    connection): the shadow must learn that its claim stands -- else the trainer, which reads
    "ok", waits for a write report that never comes."""
    proxy = StoreProxy(server.port)
    shadow = H.Handshake(lambda: _connect(proxy.port), 1, 0)
    trainer = H.Handshake(lambda: _connect(server.port), 1, 0)
    trainer.request(0, 0, {"step": 4})
    assert shadow.next_request(0, 0, 5.0) == {"step": 4}
    proxy.sever(b"/n0/claim")
    assert shadow.answer(0, 0, H.SHADOW_OK) is True
    assert proxy.fired == ["sever"]
    assert trainer.verdict(0, 0, 1.0) == H.SHADOW_OK
    proxy.close()


def test_a_hung_store_bounds_every_call(server, fast_bounds):
    """SIGSTOPped, the store answers nothing (a TCPStore call to it never returns, whatever
    its client's timeout).  Settling a claim raises `ClaimUnsettled` within its bound; a
    request wait and a write report's read return "not yet"; the server lookup says none."""
    trainer = H.Handshake(lambda: _connect(server.port), 1, 0)
    shadow = H.Handshake(lambda: _connect(server.port), 1, 0)
    shadow.serve(0, os.getpid())
    trainer.request(0, 0, {"step": 4})
    assert trainer.server() == {"epoch": 0, "pid": os.getpid()}
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(H.ClaimUnsettled, match="did not answer the checkpoint claim"):
        trainer.verdict(0, 0, 0.5)
    assert time.monotonic() - t0 < 0.5 + 2 * H.CALL_S + H.SETTLE_S + 2.0
    t0 = time.monotonic()
    assert shadow.next_request(0, 1, 0.5) is None
    assert trainer.written(0, 0) is None            # not "failed": ask again later
    assert trainer.server() is None
    assert time.monotonic() - t0 < 0.5 + 3 * H.CALL_S + 2.0
    server.cont()
    assert trainer.written(0, 0) is None and trainer.server() is not None   # back in use


def test_an_unread_claim_stops_the_trainer_for_good(monkeypatch, cleanup, server, fast_bounds):
    """The store dies between the request and the update: `before_update` raises
    `ClaimUnsettled`, which `except Exception` does not catch (a script's retry loop must not
    update anyway), and every later step raises it again."""
    from test_ckpt_snapshot_edges import _job
    job = _job(monkeypatch)
    peer = W.ShadowPeer(H.Handshake(lambda: _connect(server.port), 1, 0))
    H.Handshake(lambda: _connect(server.port), 1, 0).serve(0, os.getpid())
    ck = W.Checkpointer(Settings(directory="/nonexistent", every_steps=2, snapshot_wait_s=1.0),
                        1, lambda *a, **k: None, peer=peer)
    ck.maybe_save(job, 2)
    assert ck.pending is not None and ck.pending[0] == 2
    server.kill()
    caught = []
    with pytest.raises(H.ClaimUnsettled):
        try:
            ck.before_update(job, 2)
        except Exception as e:          # a script's retry loop
            caught.append(e)
    assert caught == []
    for call in (lambda: ck.before_update(job, 2), lambda: ck.maybe_save(job, 4)):
        with pytest.raises(H.ClaimUnsettled, match="the trainer stops before its update"):
            call()


def test_a_write_report_that_never_comes_is_given_up_on(monkeypatch, server):
    """The shadow claimed "ok" and its report is lost while it lives on: the trainer stops
    waiting after the cap, stops asking that shadow, and copies the state itself."""
    monkeypatch.setattr(W, "REPORT_CAP_S", 1.0)
    peer = W.ShadowPeer(H.Handshake(lambda: _connect(server.port), 1, 0))
    peer.last = (0, 0, os.getpid(), time.monotonic())
    assert peer.writing() is True
    time.sleep(1.2)
    info = peer.writing()
    assert info["ok"] is False and "did not report" in info["error"]
    assert peer.dead == {0} and peer.writing() is None
