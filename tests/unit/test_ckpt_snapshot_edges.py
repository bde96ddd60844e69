"""The edges of the shadow's checkpoint snapshot (`ckpt_snapshot`, `ckpt_handshake`,
`ckpt_writer`): a trainer that cannot read its claim stops instead of updating under a copy
that may count; a request that cannot be sent costs a checkpoint, not the step; a shadow whose
views went stale refuses every later request; a shadow's failed write is still reported; two
writers of one step do not tear each other; writer `shadow` waits for a serving shadow once.

Real TCPStore servers (one in a process of its own, SIGKILLed), a real state manager
(`SlotHarness`), real DCP writes."""
from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from leto_runtime import checkpoint, runtime
from leto_runtime import ckpt_handshake as H
from leto_runtime.ckpt_snapshot import SnapshotServer
from leto_runtime.ckpt_writer import ShadowPeer, write
from leto_runtime.wire import ckpt_files as F
from leto_runtime.wire.ckpt_files import Settings
from leto_testing import plain_job
from store_faults import StoreServer, connect

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from byo_model import ByoNet, byo_init, groups, make_optimizer, tokens  # noqa: E402



def _connect(port: int):
    return connect(port, timeout_s=1.0)


@pytest.fixture
def store_process():
    """A TCPStore server in a process of its own: (port, process); killed at the end."""
    server = StoreServer()
    try:
        yield server.port, server.proc
    finally:
        server.kill()


@pytest.fixture
def cleanup():
    yield
    runtime.current().forget_job()


def _job(monkeypatch, steps: int = 2):
    job = plain_job(monkeypatch, rmu=True)
    with job.meta_init():
        model = ByoNet()
    model = job.retain(model, init=byo_init)
    topt, sched = make_optimizer("adamw", groups(model, lr2=2e-3))
    opt = job.optimizer(topt, sched, clip_grad_norm=0.5)
    for step in job.steps(steps):
        _, loss = model(*tokens(step))
        loss.backward()
        opt.step()
    return job


def test_a_trainer_that_cannot_read_its_claim_stops_before_its_update(monkeypatch, store_process):
    """The store dies after the request: the claim cannot be read (the shadow may have set it),
    so settling raises `ClaimUnsettled` within its bound -- never a verdict to update on."""
    port, proc = store_process
    monkeypatch.setattr(H, "SETTLE_S", 1.5)
    peer = ShadowPeer(H.Handshake(lambda: _connect(port), 1, 0))
    peer.hs.serve(0, os.getpid())
    peer.hs.request(0, 0, {"step": 4})
    peer.asked = (0, 0, os.getpid())
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    t0 = time.monotonic()
    with pytest.raises(H.ClaimUnsettled, match="did not answer the checkpoint claim"):
        peer.settle(timeout=1.0)
    assert time.monotonic() - t0 < 30


def test_a_request_that_cannot_be_sent_leaves_the_copy_to_the_trainer(monkeypatch, cleanup,
                                                                       store_process):
    """`ask` returns None (the trainer copies the state) instead of failing the step, and a
    request that never reached the store does not use up its number."""
    port, proc = store_process
    job = _job(monkeypatch)
    peer = ShadowPeer(H.Handshake(lambda: _connect(port), 1, 0))
    peer.hs.serve(0, os.getpid())
    srv = peer.hs.server()
    assert srv == {"epoch": 0, "pid": os.getpid()}
    peer._server = lambda: srv                       # served, then the store dies
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    # The first sets after the death may seem to go out (the kernel takes the bytes) or fail
    # after they began (then the trainer claims the request at its update, which raises, as
    # above); once the client is gone none can connect: the step goes on, the trainer copies
    # the state, and the unsent request's number is reused.
    outcomes = [peer.ask(job, 2, "test") for _ in range(5)]
    k = next(i for i, o in enumerate(outcomes) if o is None)
    assert k <= 2 and outcomes[k:] == [None] * (5 - k), outcomes
    assert peer.asked is None and peer.next[0] == k, peer.next


def test_the_trainer_s_own_copy_is_the_state_at_the_top_of_the_step(monkeypatch, cleanup):
    """The copy the trainer takes when the shadow declines: `small_part` taken at the top of
    the step plus the retained states == `job.state_dict()` then, bit for bit -- even when the
    step's forward changed a buffer, a group's value or the scheduler's lists since."""
    import copy
    job = _job(monkeypatch, steps=3)
    small = checkpoint.small_part(job)
    want = copy.deepcopy(job.state_dict())
    job.model.scale.add_(1.0)                          # what a forward may do meanwhile
    job.opt.torch_opt.param_groups[0]["lr"] = 123.0
    job.opt.scheduler.base_lrs[0] = 7.0
    got = checkpoint.retained_copy(job, small)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, entry in want["optimizer"]["state"].items():
        for n, v in entry.items():
            assert torch.equal(got["optimizer"]["state"][i][n], v), (i, n)
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["scheduler"] == want["scheduler"] and got["step"] == want["step"]
    flat = job.ss.flat(job.ss.model[0])
    assert all(v.data_ptr() < flat.data_ptr() or v.data_ptr() >= flat.data_ptr()
               + flat.numel() * 4 for v in got["model"].values())    # copies, not views


def test_a_shadow_whose_views_went_stale_refuses_every_later_request(monkeypatch):
    """A state re-created with another layout under its name: the shadow's tensors show the
    old memory from then on.  The first refresh says so once; the refusal must hold for every
    later request too (until promotion maps afresh)."""
    from leto_run.state_manager import Geometry
    from leto_run.state_manager.harness import SlotHarness
    from leto_runtime.rmp.client import RmpClient
    monkeypatch.setenv("LETO_SM_FAULT_EMULATION", "truncate")
    slot = SlotHarness(device="cpu", geometry=Geometry(data_pages=32, tier1=16, tier2=1,
                                                       page_bytes=16 << 10))
    try:
        S = 16 << 10
        a = RmpClient(slot.socket)
        a.allocate("q", 3 * S, kind="process")
        a.close(unmap=False)
        shadow = RmpClient(slot.socket)
        shadow.attach("q")
        server = SnapshotServer.__new__(SnapshotServer)
        server.stale = None
        server.job = types.SimpleNamespace(ss=types.SimpleNamespace(client=shadow),
                                           recovery_info={})
        assert server._fresh_mappings() is None              # nothing changed, no loss
        a = RmpClient(slot.socket)
        a.release("q")
        a.allocate("q", 4 * S, kind="process")               # another layout, same name
        a.close(unmap=False)
        first = server._fresh_mappings()
        assert first is not None and "re-created (q)" in first
        assert server.job.recovery_info["stale_views"] is True
        assert server._fresh_mappings() == first             # and again, for good
        shadow.close()
    finally:
        slot.close()


def test_a_shadow_s_failed_write_is_reported(monkeypatch, cleanup, tmp_path):
    """A write that raises before DCP runs (here: a request without its keys) still ends with
    a report, so the active's later checkpoints are not skipped for good."""
    server_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=30))
    job = _job(monkeypatch)
    server = SnapshotServer.__new__(SnapshotServer)
    server.job, server.epoch = job, 0
    server.settings = Settings(directory=str(tmp_path))
    server.hs = H.Handshake(lambda: _connect(server_store.port), 1, 0)
    server.host, server.host_lock, server.write_busy = {}, threading.Lock(), True
    server.stopping = threading.Event()
    flats = [job.ss.flat(st)[:job.layout.numel].clone() for st in job.ss.model]
    server._write_now(0, 2, {"step": 2}, flats, "cpu", 0.0)
    trainer = H.Handshake(lambda: _connect(server_store.port), 1, 0)
    info = trainer.written(0, 0)
    assert info is not None and info["ok"] is False and "KeyError" in info["error"], info
    assert flats == [] and server.write_busy is False


def test_two_writers_of_one_step_do_not_tear_each_other(tmp_path):
    """A promoted shadow's write in flight and the same process's write of the redone step:
    each has a partial directory of its own; the first rename wins and the other counts as
    written -- not a failure, and no removal of the other's directory."""
    s = Settings(directory=str(tmp_path), keep=2)
    state = {"w": torch.arange(64.0), "step": 5}
    reports, gate, inside = [], threading.Event(), threading.Event()

    def slow_fault(point, step):
        if threading.current_thread().name == "slow":
            inside.set()
            assert gate.wait(30)

    out = {}
    slow = threading.Thread(name="slow", target=lambda: out.__setitem__("slow", write(
        state, 5, s, 1, lambda *a, **k: reports.append((a, k)), slow_fault, stall=None,
        why="t", extra={"by": "shadow"})))
    slow.start()
    assert inside.wait(30)                       # its files are there, its manifest is not
    fast = write(state, 5, s, 1, lambda *a, **k: reports.append((a, k)), lambda p, t: None,
                 stall=None, why="t", extra={"by": "trainer"})
    gate.set()
    slow.join(30)
    assert fast["ok"] and out["slow"]["ok"], (fast, out)
    assert fast["path"] == out["slow"]["path"] == str(tmp_path / F.name(5))
    assert F.check(fast["path"]).complete
    assert os.listdir(tmp_path) == [F.name(5)]           # no partial left behind
    assert not any("error" in k for _, k in reports)


def test_writer_shadow_waits_for_a_serving_shadow_once(store_process):
    """Without a shadow, the first due checkpoint waits `wait_s`; later ones do not, until a
    shadow serves again (then the next absence is waited for again)."""
    port, _ = store_process
    peer = ShadowPeer(H.Handshake(lambda: _connect(port), 1, 0), wait_s=3.0)
    t0 = time.monotonic()
    assert peer._server() is None and time.monotonic() - t0 >= 3.0
    t0 = time.monotonic()
    assert peer._server() is None and time.monotonic() - t0 < 2.0     # (not waited again)
    H.Handshake(lambda: _connect(port), 1, 0).serve(3, os.getpid())
    assert peer._server() == {"epoch": 3, "pid": os.getpid()} and peer.waited is False
    peer.dead.add(3)                                     # that shadow stopped answering
    t0 = time.monotonic()
    assert peer._server() is None and time.monotonic() - t0 >= 3.0


def test_the_write_runs_at_nice_19_in_its_own_thread_only():
    """The shadow's write yields the CPU to the active, and only its own thread does: run on
    the main thread it changes nothing (Linux keeps a nice value per thread, and the main
    thread's passes to everything it starts later)."""
    from leto_runtime.ckpt_snapshot import _lowest_priority

    seen = []

    def probe():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    base = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=_lowest_priority, args=(probe,))
    t.start()
    t.join(30)
    _lowest_priority(probe)
    assert seen == [19, base] and os.getpriority(os.PRIO_PROCESS, 0) == base


def test_the_final_checkpoint_waits_for_a_write_in_flight_instead_of_being_skipped(
        monkeypatch, cleanup, tmp_path):
    """A write still in flight skips a due checkpoint, but not the final one: the state the
    training ends with waits (bounded) for that write and is then written.  (On a busy machine
    a previous write -- a shadow's runs at nice 19 -- can outlast the steps up to the end.)"""
    from leto_runtime.ckpt_writer import Checkpointer
    job = _job(monkeypatch)
    release, reports = threading.Event(), []

    def fault(point: str, step: int) -> None:      # the write of step 2 takes until released
        if point == "checkpoint.write" and step == 2:
            release.wait(60)

    d = tmp_path / "ck"
    ck = Checkpointer(Settings(directory=str(d), every_steps=2, keep=10), 1,
                      lambda name, _s, **k: reports.append((name, k["step"])), fault=fault)
    ck.maybe_save(job, 2)
    ck.maybe_save(job, 4)                          # in flight: skipped
    t0 = time.monotonic()
    ck.maybe_save(job, 6, final=True, wait_s=0.5)  # waits its bound, then skipped all the same
    assert 0.5 <= time.monotonic() - t0 < 30
    threading.Timer(1.0, release.set).start()
    ck.finish(job, 8, 60)                          # waits for step 2's write, then writes
    assert {s: F.check(str(d / F.name(s))).complete for s in (2, 4, 6, 8)} == {
        2: True, 4: False, 6: False, 8: True}
    assert sorted(reports) == [("checkpoint", 2), ("checkpoint", 8), ("checkpoint_skipped", 4),
                               ("checkpoint_skipped", 6)]
