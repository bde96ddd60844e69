"""Resilient Memory Pool on a real GPU: cuMemCreate pages owned as fds by a context-free state
manager, retention across SIGKILLs, restart from the keeper, retired-page localization by driver
query, and reconstruction.  Run on the lent H200: `pytest tests/gpu -k rmp`."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.rmp.client import FRESH_FILL, RmpClient
from leto_runtime.rmp.reconstruct import Unrecoverable, protect, recover, reconstruct

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 1 << 20
GEOM = Geometry(data_pages=24, tier1=16, tier2=1, page_bytes=2 * MiB)   # GPU pages: 2 MiB

WRITER = r"""
import sys, time, torch
from leto_runtime.rmp.client import RmpClient
c = RmpClient(sys.argv[1])
st = c.allocate(sys.argv[2], int(sys.argv[3]), dtype="float32", shape=[int(sys.argv[3]) // 4])
t = st.tensor()
assert t.is_cuda and t.data_ptr() == st.mapping.base, (t.device, t.data_ptr())
g = torch.Generator(device="cuda").manual_seed(int(sys.argv[4]))
st.tensor(dtype="uint8").copy_(torch.randint(0, 256, (st.nbytes,), dtype=torch.uint8, device="cuda", generator=g))
torch.cuda.synchronize()
print("written", flush=True)
time.sleep(3600)
"""

READER = r"""
import sys, hashlib, torch
from leto_runtime.rmp.client import RmpClient
st = RmpClient(sys.argv[1]).attach(sys.argv[2])
print(hashlib.sha256(st.tensor(dtype="uint8").cpu().numpy().tobytes()).hexdigest())
"""


def expected(nbytes: int, seed: int) -> str:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    return hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()


def compute_apps() -> dict[int, int]:
    """pid -> MiB of every process holding a CUDA context (nvidia-smi)."""
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    out = {}
    for line in r.stdout.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        out[int(pid)] = int(mib)
    return out


@pytest.fixture(scope="module")
def slot():
    s = SlotHarness(device="cuda:0", geometry=GEOM)
    yield s
    s.close()


def spawn(slot, code, *args):
    p = subprocess.Popen([sys.executable, "-c", code, slot.socket, *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    slot.allow(p.pid)
    return p


def test_state_manager_has_no_cuda_context(slot):
    info = RmpClient(slot.socket).info["device"]
    assert info["kind"] == "cuda" and info["granularity"] == 2 * MiB
    assert RmpClient(slot.socket).status()["cuda_context"] is False
    if shutil.which("nvidia-smi"):
        c = RmpClient(slot.socket)
        c.allocate("probe", 8 * MiB, kind="process")
        apps = compute_apps()
        assert apps.get(slot.proc.pid, 0) == 0, apps      # not listed: no context, 0 MiB
        c.release("probe")


def test_retention_and_state_manager_restart_on_gpu(slot):
    nbytes = 5 * 2 * MiB + 4096
    w = spawn(slot, WRITER, "gpu.params", nbytes, 11)
    assert w.stdout.readline().strip() == "written", w.stderr.read()
    w.send_signal(signal.SIGKILL)
    w.wait(timeout=30)
    r = spawn(slot, READER, "gpu.params")
    out, err = r.communicate(timeout=120)
    assert out.strip() == expected(nbytes, 11), err
    slot.restart()                                   # SIGKILL + respawn from the keeper's fds
    r = spawn(slot, READER, "gpu.params")
    out, err = r.communicate(timeout=120)
    assert out.strip() == expected(nbytes, 11), err
    RmpClient(slot.socket).release("gpu.params")


def test_retired_pages_localized_and_reconstructed(slot):
    n = 48                                           # two groups of 24 pages
    c = RmpClient(slot.socket)
    st = c.allocate("gpu.w", n * 2 * MiB)
    data = torch.randint(0, 256, (n, 2 * MiB), dtype=torch.uint8, device="cuda")
    st.pages().copy_(data)
    protect(st)
    parity = [st.tier1(g.index).clone() for g in st.groups]
    g0, g1 = (g.id for g in st.groups)
    del st
    c.close()
    rep = c.inject_pages(tier="device", group=g0, first=4, count=16)     # a DRAM row
    assert rep["emulation"] == "retired"
    c.inject_pages(tier="host", group=g0, part="p1", first=2)
    c2 = RmpClient(slot.socket)                     # the promoted trainer
    st2 = c2.attach("gpu.w")
    loc, rec = recover(c2)
    assert loc.marks["gpu.w"].data == list(range(4, 20)) and loc.marks["gpu.w"].p1 == {0: [2]}
    assert torch.equal(st2.pages(), data)
    for g in st2.groups:
        assert torch.equal(st2.tier1(g.index), parity[g.index])
    # 17 device pages lost in group 0 (and 16 in group 1): typed result, nothing overwritten
    c2.inject_pages(tier="device", group=g0, first=0, count=4)
    c2.inject_pages(tier="device", group=g0, first=11, count=13)
    c2.inject_pages(tier="device", group=g1, first=0, count=16)
    del st2
    c2.close()
    c3 = RmpClient(slot.socket)
    st3 = c3.attach("gpu.w")
    c3.localize()
    c3.remap()
    with pytest.raises(Unrecoverable):
        reconstruct(c3)
    pages = st3.pages()
    assert torch.equal(pages[4:11], data[4:11]) and torch.equal(pages[40:48], data[40:48])
    assert (pages[0:4] == FRESH_FILL).all() and (pages[24:40] == FRESH_FILL).all()
    del pages, st3
    c3.release("gpu.w")


def test_attach_after_a_host_parity_loss_pins_and_leaves_cuda_clean(slot):
    """A host parity page lost before a trainer attaches (a shadow spawned after the loss) is a
    truncated memfd: the range cannot be page-locked whole.  The attach still pins every
    readable run, leaves no CUDA error behind for torch's next launch check, and the repair
    pins the whole range again."""
    c = RmpClient(slot.socket)
    st = c.allocate("gpu.lostp1", 24 * 2 * MiB)
    data = torch.randint(0, 256, (24, 2 * MiB), dtype=torch.uint8, device="cuda")
    st.pages().copy_(data)
    protect(st)
    p1 = st.tier1(0).clone()
    gid = st.groups[0].id
    del st
    c.close()
    c.inject_pages(tier="host", group=gid, part="p1", first=3)
    c2 = RmpClient(slot.socket)
    try:
        st2 = c2.attach("gpu.lostp1")
        pm = st2.parity_mapping
        assert pm.pinned and len(pm._runs) == 2, pm._runs
        x = torch.ones(4, device="cuda") * 2           # a launch: its check must find no error
        torch.cuda.synchronize()
        assert float(x.sum()) == 8.0
        loc, _ = recover(c2)
        assert loc.marks["gpu.lostp1"].p1 == {0: [3]}
        pm = st2.parity_mapping                          # after the repair
        assert pm.pinned and pm._runs == [(0, pm.n_pages)]
        assert torch.equal(st2.pages(), data) and torch.equal(st2.tier1(0), p1)
        del st2, pm
    finally:
        c2.close()
        RmpClient(slot.socket).release("gpu.lostp1")
