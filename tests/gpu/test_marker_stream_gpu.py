"""Stream-ordered marker writes (Marker.write_async, cuda/marker_stream.cpp) on the GPU.

Both modes: a host function applies the payload (cuda/marker_stream.cpp), or a one-block kernel
stores it into registered host memory (cuda/marker_kernel.cu).
Oracle: the synchronous host path (Marker.write) applied to a second marker page: after the same
records, both pages and their parity rows must hold the same bytes, and the parity must be the
fresh encode of the page.  Ordering: writes queued behind a long kernel must not be visible
before the kernel ends, and must all be visible after settle()."""
from __future__ import annotations

import time

import pytest
import torch

from leto_runtime.parity import ParityCode
from leto_runtime.rmu.marker import GState, Marker, Phase, Record
from leto_runtime.rmu.states import Geometry, LocalState

GEO = Geometry(8, 16, 1, 4096)


def _marker(pinned: bool = False):
    st = LocalState("leto/marker", 4096, GEO, "cpu", True)
    if pinned:      # page-locked: a copy from it is a DMA that reads when the stream gets there
        st._data = st._data.pin_memory()
    m = Marker(st, backend="cpu")
    m.write(initialized=1, t=0, phase=Phase.DONE)
    return st, m


def _records(n):
    for t in range(1, n + 1):
        yield dict(t=t, phase=Phase.UPDATING, group=t % 3, chunk=t % 5, sub=t % 2, auth=(t // 2) % 2,
                   gstate=GState.CHUNKS, coef_bits=0x3F000000 + t, coef_t=t)


MODES = ["hostfunc", "kernel"]


@pytest.mark.parametrize("mode", MODES)
def test_async_writes_equal_host_writes_and_keep_parity(mode):
    sa, a = _marker()
    sb, b = _marker()
    assert a.use_stream("cuda", mode)
    for r in _records(37):
        a.write_async(**r)
        b.write(**r)
    assert a._mirror.kernel == (mode == "kernel")          # the mode asked for is the one used
    a.settle()
    assert a.rec == b.rec
    assert Marker(sa, backend="cpu").read() == b.rec          # what a promoted trainer reads
    assert torch.equal(sa.pages(0, 1), sb.pages(0, 1))
    assert torch.equal(sa.tier1(0), sb.tier1(0)) and torch.equal(sa.tier2(0), sb.tier2(0))
    code = ParityCode(1, GEO.tier1, GEO.page_bytes, backend="reference")
    assert torch.equal(code.encode(sa.pages(0, 1)), sa.tier1(0))
    # a host write after queued ones settles them first, then lands on top
    a.write_async(t=99, phase=Phase.SYNCED)
    a.write(t=100, phase=Phase.COMPUTE)
    assert Marker(sa, backend="cpu").read().t == 100


@pytest.mark.parametrize("mode", MODES)
def test_async_writes_wait_for_the_stream(mode):
    st, m = _marker()
    assert m.use_stream("cuda", mode)
    # A first write makes the update's mirror (kernel mode registers the marker's pages then,
    # which may wait for the device): done before any work is queued, as its own step.
    m.write_async(t=0, phase=Phase.SYNCED)
    torch.cuda.synchronize()
    rate = torch.cuda.get_device_properties(0).clock_rate * 1e3     # cycles per second (approx.)
    torch.cuda._sleep(int(0.5 * rate))                               # ~0.5 s of GPU work queued first
    queued = torch.cuda.Event()
    queued.record()
    for r in _records(5):
        m.write_async(**r)
    assert m.rec.t == 5                                              # queued (logical)
    seen = Marker(st, backend="cpu").read()
    ahead_done = queued.query()                  # after the read: pending now, pending then
    assert ahead_done or (seen.t == 0 and seen.phase == Phase.SYNCED), \
        f"a marker write landed before the work queued ahead of it: {seen}"
    assert not ahead_done, "write_async waited for the work queued ahead of it (0.5 s)"
    t0 = time.perf_counter()
    m.settle()
    assert time.perf_counter() - t0 > 0.05
    assert Marker(st, backend="cpu").read() == m.rec


@pytest.mark.parametrize("mode", MODES)
def test_work_queued_after_a_marker_write_waits_for_it(mode):
    """The guard direction: an operation queued after write_async runs only once the record is
    in memory (cudaLaunchHostFunc holds back later work of the stream): a DMA copy of the
    marker block queued after each write sees exactly that write."""
    st, m = _marker(pinned=True)
    assert m.use_stream("cuda", mode)
    blk = st.pages(0, 1).view(-1)[:1024]
    snaps = torch.empty((20, 1024), dtype=torch.uint8, device="cuda")
    recs = []
    for i, r in enumerate(_records(20)):
        recs.append(m.write_async(**r))
        snaps[i].copy_(blk, non_blocking=True)
    m.settle()
    torch.cuda.synchronize()
    assert st.pages(0, 1).is_pinned()
    for i, rec in enumerate(recs):
        w = snaps[i].cpu().view(torch.int64).tolist()
        cur = w[32]
        assert Record.from_words(w[cur * 16:(cur + 1) * 16]) == rec, i


@pytest.mark.parametrize("stream_marker", ["1", "kernel", "0"])
def test_updater_marker_is_settled_when_update_returns(monkeypatch, stream_marker):
    from leto_runtime.rmu.adamw import AdamWConfig
    from leto_runtime.rmu.states import Layout, open_states
    from leto_runtime.rmu.updater import Updater
    monkeypatch.setenv("LETO_RMU_STREAM_MARKER", stream_marker)
    geo = Geometry(3, 16, 1, 2 << 20)
    layout = Layout.of([("a", (2_000_000,))], geo.page_bytes)
    ss = open_states(layout, client=None, geo=geo, device="cuda", chunk_pages=1)
    up = Updater(ss, AdamWConfig(lr=1e-3, clip_grad_norm=1.0, total_steps=5), lend=False)
    assert up.streamed == (stream_marker != "0")
    assert up.marker.mode == ({"1": "hostfunc", "kernel": "kernel"}.get(stream_marker))
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=-1, phase=Phase.DONE)
    G = ss.flat(ss.grads)
    for t in range(3):
        up.begin(t)
        G.normal_()
        up.step(t)
        assert Marker(ss.marker, backend="cpu").read() == up.marker.rec
        assert up.marker.rec.phase == Phase.DONE and up.marker.rec.t == t
    up.close()
