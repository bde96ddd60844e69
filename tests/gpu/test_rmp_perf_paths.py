"""The RMP's fast paths on a real GPU (docs/BENCHMARKS.md, "Resilient Memory Pool"):

* the native device-page probe (cuda/rmp_probe.cpp) reports exactly the pages the emulated fault
  retired (and pages unmapped locally), the same list as its reference, the cuda-python loop;
* the CUDA reconstruction path (address arrays, split decode; reconstruct._repair_group_cuda)
  rebuilds data and parity bit-exactly for every loss shape it handles, as does the staged path
  (ParityCode pages, its reference), with the fast path verified to have run.

Run on the lent H200: `pytest tests/gpu -k perf_paths`."""
from __future__ import annotations

import pytest
import torch

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.rmp import mapping
from leto_runtime.rmp import reconstruct as R
from leto_runtime.rmp.client import RmpClient

# tests/gpu/conftest.py marks every test here `gpu` and skips it, with the reason, without CUDA.

MiB = 1 << 20
P = 2 * MiB
GEOM = Geometry(data_pages=24, tier1=16, tier2=1, page_bytes=P)


@pytest.fixture(scope="module")
def slot():
    s = SlotHarness(device="cuda:0", geometry=GEOM)
    yield s
    s.close()


def test_native_probe_finds_exactly_the_injected_pages(slot):
    fn = mapping.native_probe()
    assert fn is not None, "the CUDA extension (native probe) must build on the GPU machine"
    c = RmpClient(slot.socket)
    st = c.allocate("probe.w", 72 * P)                # three groups of 24 pages
    gids = [g.id for g in st.groups]
    del st
    c.close()
    c.inject_pages(tier="device", group=gids[0], first=3, count=5)
    c.inject_pages(tier="device", group=gids[2], first=23, count=1)
    c2 = RmpClient(slot.socket)
    st = c2.attach("probe.w")
    m = st.mapping
    want = [3, 4, 5, 6, 7, 48 + 23]
    assert m.probe() == want
    assert m.probe_python() == want
    assert c2.localize().marks["probe.w"].data == want
    sub = [71, 0, 3, 3, 50, 72, 7, 4, -1]             # order, duplicates and out-of-range as the reference
    assert m.probe(sub) == m.probe_python(sub)
    assert [i for i in m.probe(sub) if 0 <= i < 72] == [71, 3, 3, 7, 4]
    assert m.probe([]) == []
    m.unmap_page(10)                                  # a page gone locally is found too
    assert m.probe() == sorted(want + [10]) == m.probe_python()
    assert list(fn(m.base, m.page_bytes, m.n_pages, None, 4)) == sorted(want + [10])   # threads
    c2.close()
    RmpClient(slot.socket).release("probe.w")


# name -> losses, as inject_pages(**kw) calls (g: the group's position in the state)
CASES = {
    "dram_row": [dict(tier="device", g=0, first=4, count=16)],
    "data_and_p1_via_tier2": [dict(tier="device", g=0, first=0, count=15),
                              dict(tier="host", g=0, part="p1", first=5)],
    "p1_beyond_tier2": [dict(tier="device", g=0, first=2, count=3),
                        dict(tier="host", g=0, part="p1", first=1, count=2)],
    "p2_only": [dict(tier="host", g=1, part="p2", first=0)],
    "data_and_p2": [dict(tier="device", g=1, first=20, count=4),
                    dict(tier="host", g=1, part="p2", first=0)],
    "spread": [dict(tier="device", g=0, first=23, count=1), dict(tier="device", g=1, first=0, count=16),
               dict(tier="device", g=2, first=7, count=2)],
}


@pytest.mark.parametrize("path", ["cuda", "staged"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reconstruction_exact(slot, case, path, monkeypatch):
    calls = []
    real = R._repair_group_cuda
    monkeypatch.setattr(R, "_repair_group_cuda", lambda *a: (calls.append(a[1]), real(*a))[1])
    monkeypatch.setenv("LETO_RMP_RECONSTRUCT_PATH", "auto" if path == "cuda" else "staged")
    name = f"rec.{case}.{path}"
    c = RmpClient(slot.socket)
    st = c.allocate(name, 72 * P)
    g = torch.Generator(device="cuda").manual_seed(hash(name) % 1000)
    data = torch.randint(0, 256, (72, P), dtype=torch.uint8, device="cuda", generator=g)
    st.pages().copy_(data)
    R.protect(st)
    p1 = [st.tier1(x.index).clone() for x in st.groups]
    p2 = [st.tier2(x.index).clone() for x in st.groups]
    gids = [x.id for x in st.groups]
    del st
    c.close()
    for inj in CASES[case]:
        kw = dict(inj)
        c.inject_pages(group=gids[kw.pop("g")], **kw)
    c2 = RmpClient(slot.socket)
    st = c2.attach(name)
    loc, rep = R.recover(c2)
    assert rep.pages == sum(i.get("count", 1) for i in CASES[case])
    assert torch.equal(st.pages(), data)
    for x in st.groups:
        assert torch.equal(st.tier1(x.index), p1[x.index]), x.index
        assert torch.equal(st.tier2(x.index), p2[x.index]), x.index
    assert len(calls) == (len(rep.repaired) if path == "cuda" else 0)
    del st
    c2.close()
    RmpClient(slot.socket).release(name)


def test_stage_profile_and_unrecoverable_untouched(slot, monkeypatch):
    """STAGE_TIMES records the fast path's stages; 17 lost pages still raise before any write."""
    c = RmpClient(slot.socket)
    st = c.allocate("rec.prof", 24 * P)
    data = torch.randint(0, 256, (24, P), dtype=torch.uint8, device="cuda")
    st.pages().copy_(data)
    R.protect(st)
    gid = st.groups[0].id
    del st
    c.close()
    c.inject_pages(tier="device", group=gid, first=0, count=16)
    c2 = RmpClient(slot.socket)
    st = c2.attach("rec.prof")
    monkeypatch.setattr(R, "STAGE_TIMES", [])
    R.recover(c2)
    names = [n for n, _ in R.STAGE_TIMES]
    assert "decode kernel, data pages" in names and "parity term (delta kernel)" in names, names
    assert torch.equal(st.pages(), data)
    del st
    c2.close()
    c.inject_pages(tier="device", group=gid, first=0, count=17)
    c3 = RmpClient(slot.socket)
    st = c3.attach("rec.prof")
    c3.localize()
    c3.remap()
    with pytest.raises(R.Unrecoverable):
        R.reconstruct(c3)
    assert torch.equal(st.pages()[17:], data[17:])
    del st
    c3.release("rec.prof")
