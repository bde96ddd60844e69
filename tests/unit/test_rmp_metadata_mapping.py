"""RMP pieces without processes: group layout and snapshots; page mapping, probes, views."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from leto_run.state_manager.metadata import Geometry, PoolMeta, SnapshotError
from leto_runtime.wire import protocol as P
from leto_runtime.wire.host_pages import HostMapping, scan_range
from leto_runtime.rmp.tensors import ViewRegistry, make_tensor

G = Geometry(data_pages=32, tier1=16, tier2=1, page_bytes=16 << 10)


def test_geometry_checks():
    assert not G.problems() and not Geometry().problems()
    assert Geometry().to_json() == {"data_pages": 1024, "tier1": 16, "tier2": 1,
                                    "page_bytes": 2 << 20}
    for bad in (Geometry(tier1=17), Geometry(data_pages=0), Geometry(page_bytes=1000),
                Geometry(tier2=2, tier1=1), Geometry(data_pages=65530)):
        assert bad.problems()


def test_groups_and_snapshot_roundtrip():
    m = PoolMeta(G, G.page_bytes)
    st = m.plan_state("w", 80 * G.page_bytes - 5, "model", True, "device", "float32", None)
    m.add_state(st)
    m.add_state(m.plan_state("scratch", 100, "process", False, "host", None, None))
    assert [(g.first, g.k, len(g.p1), len(g.p2)) for g in st.groups] == \
        [(0, 32, 16, 1), (32, 32, 16, 1), (64, 16, 16, 1)]
    ids = m.all_page_ids()
    assert len(ids) == len(set(ids)) == 80 + 3 * 17 + 1
    assert m.where[st.groups[1].p1[3]].describe() == \
        {"state": "w", "role": "p1", "index": 3, "group": 1, "tier": "host"}
    f = m.flag(st.data[40])
    f.failed = f.needs_remap = True
    m.flag(st.groups[2].p2[0]).poisoned = True
    assert m.marks(st)["data"] == [40] and m.marks(st)["unmapped"] == [["data", 1, 40]]
    snap = m.snapshot()
    again = PoolMeta.from_snapshot(snap)
    assert again.snapshot() == snap and again.flag(st.groups[2].p2[0]).poisoned
    assert len(str(snap)) < 20_000


@pytest.mark.parametrize("mutate", [
    lambda s: s.update(snapshot_version=9),
    lambda s: s["states"][0]["data"].append(s["states"][0]["data"][0]),
    lambda s: s["states"][0]["groups"].pop(),
    lambda s: s["geometry"].update(tier1=99),
    lambda s: s.update(next_page=1),
    lambda s: s["flags"].update({"1": "zz"}),
    lambda s: s["states"].append("junk"),
])
def test_bad_snapshots_are_refused(mutate):
    m = PoolMeta(G, G.page_bytes)
    m.add_state(m.plan_state("w", 40 * G.page_bytes, "model", True, "device", None, None))
    m.flag(1).failed = True
    snap = m.snapshot()
    mutate(snap)
    with pytest.raises(SnapshotError):
        PoolMeta.from_snapshot(snap)


def memfd(n: int, fill: int) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    os.pwrite(fd, bytes([fill]) * n, 0)
    return fd


def test_host_mapping_back_to_back_and_probe_bisection():
    P_ = 16 << 10
    n = 64
    hm = HostMapping(n, P_)
    fds = [memfd(P_, i) for i in range(n)]
    keep = [os.dup(fd) for fd in fds]
    hm.map_pages(list(enumerate(fds)))                 # consumes (closes) the fds
    reg = ViewRegistry("t")
    t = make_tensor(hm.addr(0), n * P_, "cpu", reg, shape=(n, P_))
    assert t.data_ptr() == hm.base and [int(t[i, 5]) for i in (0, 9, 63)] == [0, 9, 63]
    assert hm.probe() == []
    for bad in (0, 17, 18, 63):
        os.ftruncate(keep[bad], 0)                      # the CPU stand-in of a lost page
    assert hm.probe() == [0, 17, 18, 63]
    assert scan_range(hm.base, n, P_, pages=range(10, 20)) == [17, 18]
    hm.unmap_page(5)
    assert hm.probe(range(0, 8)) == [0, 5]              # an unmapped hole is reported too
    hm.map_page(17, memfd(P_, 0xEE))                    # remap: fresh memory in place
    assert int(t[17, 0]) == 0xEE and 17 not in hm.probe()
    with pytest.raises(P.ViewsAlive):
        reg.wait_dead(0.05)
    v = t[3]                                            # a view of a view keeps it alive
    del t
    assert reg.alive() == 1
    del v
    reg.wait_dead(1.0)
    hm.close()
    P.close_fds(keep)


def test_tensor_dtypes_and_shapes_are_views():
    hm = HostMapping(1, 4096)
    hm.map_page(0, memfd(4096, 0))
    reg = ViewRegistry("t")
    f = make_tensor(hm.base, 4096, "cpu", reg, dtype="float32", shape=(32, 32))
    f[1, 2] = 1.5
    b = make_tensor(hm.base, 4096, "cpu", reg)
    assert f.dtype == torch.float32 and b.view(torch.float32)[34].item() == 1.5
    assert np.frombuffer(bytes(b[136:140].numpy()), np.float32)[0] == 1.5
    with pytest.raises(ValueError):
        make_tensor(hm.base, 4096, "cpu", reg, dtype="complex64")
    del f, b
    reg.wait_dead(1.0)
    hm.close()
