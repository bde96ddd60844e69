"""GPU: the native cold attach (cuda/rmp_map.cpp) maps what the cuda-python reference maps, and
a pre-attached mapping (a shadow that attached while it waited) is brought up to date by
`RmpClient.refresh` -- pages remapped elsewhere re-imported in place, pages retired after the
pre-attach unmapped here so localize -> remap -> reconstruct finds and rebuilds them.

Needs no parity extension: the probe uses the cuda-python loop and the codec the NumPy
reference (small groups), so it runs while the extension builds."""
from __future__ import annotations

import pytest
import torch

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.rmp import mapping
from leto_runtime.rmp.client import RmpClient
from leto_runtime.rmp.reconstruct import protect, recover

MiB = 1 << 20
GEOM = Geometry(data_pages=24, tier1=16, tier2=1, page_bytes=2 * MiB)
REF = "reference"


@pytest.fixture(scope="module")
def slot():
    s = SlotHarness(device="cuda:0", geometry=GEOM)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def python_probe():
    with mapping.override_native_probe(False):          # no extension build needed here
        yield


@pytest.mark.parametrize("path, threads, once", [("python", 1, False), ("native", 1, True),
                                                   ("native", 4, True), ("native", 3, False)])
def test_native_attach_maps_what_the_reference_maps(slot, monkeypatch, path, threads, once):
    n = 300                                              # > one fd message, < one batch
    c = RmpClient(slot.socket)
    st = c.retain("gpu.cold", n * 2 * MiB, kind="process")
    ref = torch.arange(n, dtype=torch.int32, device="cuda").repeat_interleave(2 * MiB // 4)
    st.tensor(dtype="int32").copy_(ref)
    torch.cuda.synchronize()
    del st
    c.close()
    monkeypatch.setenv("LETO_RMP_MAP", path)          # knobs are read at each attach
    monkeypatch.setenv("LETO_RMP_MAP_THREADS", str(threads))
    monkeypatch.setenv("LETO_RMP_GRANT_ONCE", "1" if once else "0")
    monkeypatch.setenv("LETO_RMP_MAP_BATCH", "256")
    c = RmpClient(slot.socket)
    st = c.attach("gpu.cold")
    if path == "native":
        from leto_runtime.rmp import native_map
        assert native_map.load() is not None
    assert st.mapping.mapped == set(range(n)) and st.probe() == []
    t = st.tensor(dtype="int32")
    assert torch.equal(t, ref)
    t[:4].fill_(-1)                                     # writable; visible to the next importer
    torch.cuda.synchronize()
    del t
    c.close()
    c = RmpClient(slot.socket)
    t = c.attach("gpu.cold").tensor(dtype="int32")
    assert t[:4].tolist() == [-1] * 4 and torch.equal(t[4:], ref[4:])
    t[:4] = ref[:4]
    torch.cuda.synchronize()
    del t
    c.close()


def _fill(slot, name, n):
    c = RmpClient(slot.socket)
    st = c.allocate(name, n * 2 * MiB)
    data = torch.randint(0, 256, (n, 2 * MiB), dtype=torch.uint8, device="cuda")
    st.pages().copy_(data)
    protect(st, backend=REF)
    parity = [st.tier1(g.index).clone() for g in st.groups]
    del st
    c.close()
    return data, parity


def test_faults_after_pre_attach_on_gpu(slot):
    data, parity = _fill(slot, "gpu.pre", 48)
    shadow = RmpClient(slot.socket)
    st = shadow.attach("gpu.pre")                        # while waiting
    view = st.pages()
    g0 = st.groups[0].id
    inj = RmpClient(slot.socket)
    assert inj.inject_pages(tier="device", group=g0, first=4, count=16)["emulation"] == "retired"
    inj.inject_pages(tier="host", group=g0, part="p1", first=2)
    inj.close()
    assert st.probe() == []                             # the stale mapping still holds them
    rep = shadow.refresh()                              # promotion
    assert rep.dropped == {"gpu.pre": 16} and sorted(st.probe()) == list(range(4, 20))
    loc, rec = recover(shadow, backend=REF)
    assert loc.marks["gpu.pre"].data == list(range(4, 20)) and loc.marks["gpu.pre"].p1 == {0: [2]}
    assert torch.equal(view, data)                      # rebuilt under the same addresses
    for g in st.groups:
        assert torch.equal(st.tier1(g.index), parity[g.index])
    del view
    shadow.close()
    RmpClient(slot.socket).release("gpu.pre")


def test_pages_remapped_elsewhere_reimported_in_place(slot):
    data, parity = _fill(slot, "gpu.re", 24)
    shadow = RmpClient(slot.socket)
    st = shadow.attach("gpu.re")
    view, base = st.pages(), st.mapping.base
    a = RmpClient(slot.socket)
    a.inject_pages(tier="device", group=st.groups[0].id, first=8, count=3)
    sa = a.attach("gpu.re")
    recover(a, backend=REF)
    assert torch.equal(sa.pages(), data)
    del sa
    a.close()
    rep = shadow.refresh()
    assert rep.changed == {"gpu.re": 3} and st.mapping.base == base
    assert torch.equal(view, data) and shadow.localize().failed() == 0
    del view
    shadow.close()
    RmpClient(slot.socket).release("gpu.re")
