"""The shadow's checkpoint snapshot (`leto_runtime.ckpt_snapshot`, `ckpt_handshake`): the
state it assembles from copies of retained memory is the active's `job.state_dict()` bit for
bit, and the claim over a real TCPStore lets exactly one side decide -- a late copy never
counts, a forged value never counts."""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from leto_runtime import checkpoint, runtime
from leto_runtime import ckpt_handshake as H
from leto_runtime.auth_store import AuthStore
from leto_runtime.ckpt_snapshot import staging_place
from leto_testing import plain_job

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from byo_model import ByoNet, byo_init, freeze, groups, make_optimizer, tokens  # noqa: E402

KEY = bytes(range(32))


@pytest.fixture
def cleanup():
    yield
    runtime.current().forget_job()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_the_shadow_s_state_is_the_active_s_state_dict_bit_for_bit(monkeypatch, cleanup, kind):
    """Tied head, frozen sub-module, constant buffer, two groups with their own values, a
    scheduler: `assemble(small_part, flat copies)` == `job.state_dict()` in every key, value
    and bit, after 3 RMU steps."""
    job = plain_job(monkeypatch, rmu=True)
    with job.meta_init():
        model = ByoNet()
    model = job.retain(model, init=byo_init)
    freeze(model)
    topt, sched = make_optimizer(kind, groups(model, lr2=2e-3))
    opt = job.optimizer(topt, sched, clip_grad_norm=0.5)
    for step in job.steps(3):
        _, loss = model(*tokens(step))
        loss.backward()
        opt.step()
    want = job.state_dict()
    small = H.unpack(H.pack(checkpoint.small_part(job)))          # as the store carries it
    flats = [job.ss.flat(st)[:job.layout.numel].clone() for st in job.ss.model]
    got = checkpoint.assemble(job, small, flats)
    assert list(got["model"]) == list(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v) and got["model"][k].dtype == v.dtype, k
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for i, entry in want["optimizer"]["state"].items():
        assert entry.keys() == got["optimizer"]["state"][i].keys()
        for n, v in entry.items():
            assert torch.equal(got["optimizer"]["state"][i][n], v), (i, n)
    assert got["scheduler"] == want["scheduler"] and got["step"] == want["step"] == 3


@pytest.fixture
def stores():
    """A real TCPStore server and two authenticated clients of it: the trainer's, the shadow's."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))

    def connect():
        raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=30))
        return AuthStore(raw, KEY)
    return server, (lambda: H.Handshake(connect, 1, 0)), (lambda: H.Handshake(connect, 1, 0))


def test_a_copy_claimed_in_time_counts_and_a_late_one_never_does(stores):
    _, trainer_hs, shadow_hs = stores
    trainer, shadow = trainer_hs(), shadow_hs()
    assert trainer.server() is None                  # nobody serves yet: the trainer copies
    shadow.serve(epoch=0, pid=os.getpid())
    assert trainer.server() == {"epoch": 0, "pid": os.getpid()}
    # request 0: the shadow answers while the trainer waits
    trainer.request(0, 0, {"step": 5})
    got = []
    t = threading.Thread(target=lambda: got.append(shadow.next_request(0, 0, 5.0)))
    t.start()
    t.join(10)
    assert got == [{"step": 5}]
    assert shadow.answer(0, 0, H.SHADOW_OK)
    assert trainer.verdict(0, 0, 5.0) == H.SHADOW_OK
    # request 1: the trainer gives up first; the shadow's late copy is refused
    trainer.request(0, 1, {"step": 6})
    assert trainer.verdict(0, 1, 0.2) == H.TRAINER
    assert shadow.next_request(0, 1, 5.0) == {"step": 6}
    assert not shadow.answer(0, 1, H.SHADOW_OK)
    # the shadow reports its write; the trainer sees it once it is there
    assert trainer.written(0, 0) is None
    shadow.report_written(0, 0, {"ok": True, "write_s": 1.5})
    # None also means "the store did not answer: ask again" (a loaded machine); the trainer
    # asks again at its next step, the test every 50 ms
    end, seen = time.monotonic() + 30, None
    while seen is None and time.monotonic() < end:
        seen = trainer.written(0, 0)
        time.sleep(0 if seen else 0.05)
    assert seen == {"ok": True, "write_s": 1.5}


def test_a_forged_claim_or_request_never_counts(stores):
    server, trainer_hs, shadow_hs = stores
    trainer, shadow = trainer_hs(), shadow_hs()
    claim = H.base(1, 0, 0, 0) + "/claim"
    server.set(claim, H.SHADOW_OK)                  # another user of the machine, no job key
    trainer.request(0, 0, {"step": 5})
    verdict = trainer.verdict(0, 0, 1.0)
    assert verdict.startswith(H.SHADOW_SKIP), verdict   # the trainer copies the state itself
    assert not shadow.answer(0, 0, H.SHADOW_OK)
    server.set(H.base(1, 0, 0, 1) + "/req", b"not signed")
    with pytest.raises(Exception):
        shadow.next_request(0, 1, 1.0)


def test_the_staging_copy_goes_to_the_device_only_with_room_beside_the_active():
    GiB = 1 << 30
    assert staging_place(free=60 * GiB, need=13 * GiB, total=140 * GiB)[0] == "device"
    place, why = staging_place(free=18 * GiB, need=13 * GiB, total=140 * GiB)
    assert place == "host" and "7.00 GiB" in why          # the margin: 5% of 140 GiB
    assert staging_place(free=3 * GiB, need=1 * GiB, total=16 * GiB)[0] == "device"
    assert staging_place(free=3 * GiB, need=int(1.5 * GiB), total=16 * GiB)[0] == "host"


def test_a_shadow_that_dies_while_it_writes_does_not_stop_the_checkpoints(stores):
    """The trainer sends no request while the shadow writes the last one it claimed; a shadow
    that died before reporting its write (its partial directory is torn) must not keep it
    waiting for good."""
    import subprocess
    import time
    from leto_runtime.ckpt_writer import ShadowPeer
    _, trainer_hs, shadow_hs = stores
    peer = ShadowPeer(trainer_hs())
    peer.last = (0, 0, os.getpid(), time.monotonic())
    assert peer.writing() is True                      # alive, not reported: still writing
    shadow_hs().report_written(0, 0, {"ok": True, "write_s": 2.0})
    assert peer.writing() == {"ok": True, "write_s": 2.0} and peer.writing() is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    peer.last = (0, 1, gone.pid, time.monotonic())
    info = peer.writing()
    assert info["ok"] is False and f"pid {gone.pid}" in info["error"]
    assert peer.writing() is None                      # the next request may go out


def test_the_active_waits_for_a_copy_slower_than_one_wait_slice(stores):
    """A shadow that claims 1.5 s after the request (a host-staged copy of a large model) still
    counts: the active waits in slices and claims only at its deadline."""
    import time
    from leto_runtime.ckpt_writer import ShadowPeer
    _, trainer_hs, shadow_hs = stores
    peer = ShadowPeer(trainer_hs())
    peer.asked = (0, 0, os.getpid())
    shadow = shadow_hs()
    t = threading.Thread(target=lambda: (time.sleep(1.5), shadow.answer(0, 0, H.SHADOW_OK)))
    t.start()
    verdict, waited = peer.settle(20.0)
    t.join(10)
    assert verdict == H.SHADOW_OK and 1.4 < waited < 15, (verdict, waited)
    assert peer.dead == set() and peer.last[:3] == (0, 0, os.getpid())
