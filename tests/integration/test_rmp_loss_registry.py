"""The state manager's loss registry as a live trainer sees it (issue "trust at the edges",
item 1): a lost page is registered and announced on the loss bulletin before anyone can read it
again, and it can never be read -- a mapping of it traps, as real poison does, instead of
handing out destroyed bytes that could flow into parity.  Real state-manager processes."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.rmp.client import RmpClient
from leto_runtime.rmp.reconstruct import protect, recover

GEOM = Geometry(data_pages=8, tier1=4, tier2=1, page_bytes=4096)
S = GEOM.page_bytes


@pytest.fixture
def slot():
    s = SlotHarness(device="cpu", geometry=GEOM)
    yield s
    s.close()


def _gid(c, name, index):
    return next(s for s in c.list() if s["name"] == name)["groups"][index]


@pytest.mark.parametrize("tier,part", [("host", "p1"), ("host", "p2"), ("device", "data")])
def test_a_loss_is_registered_announced_and_counted_until_repaired(slot, tier, part):
    c = RmpClient(slot.socket)
    st = c.allocate("a", 16 * S)
    st.pages().fill_(7)
    protect(st, backend="reference")
    p1, p2 = st.tier1(1).clone(), st.tier2(1).clone()      # what the parity must be again
    before = c.loss_count()
    assert before is not None and c.status()["pending_losses"] == 0
    c.inject_pages(tier=tier, part=part, group=_gid(c, "a", 1), first=0, count=1)
    assert c.loss_count() == before + 1                # announced, no round trip needed
    assert c.status()["pending_losses"] >= 1
    recover(c, backend="reference")                    # localize, remap, rebuild, clear marks
    assert c.status()["pending_losses"] == 0
    assert bool((st.pages() == 7).all())
    assert torch.equal(st.tier1(1), p1) and torch.equal(st.tier2(1), p2)   # parity rebuilt


_READER = """
import sys
from leto_runtime.rmp.client import RmpClient
c = RmpClient(sys.argv[1])
st = c.attach("a")
print("mapped", flush=True)
sys.stdin.readline()                                  # the parent injects the loss now
part = sys.argv[2]
row = st.tier1(1)[0] if part == "p1" else st.pages(8, 1)[0]
print("read", int(row.sum()), flush=True)            # must not get here with destroyed bytes
"""


@pytest.mark.parametrize("tier,part", [("host", "p1"), ("device", "data")])
def test_a_lost_page_traps_in_a_live_mapping_instead_of_reading_destroyed_bytes(slot, tier, part):
    """A trainer that mapped the page before the loss and reads it after: SIGBUS (the emulation
    truncates the page, atomically for every mapping), never the old or random bytes."""
    c = RmpClient(slot.socket)
    st = c.allocate("a", 16 * S)
    st.pages().fill_(3)
    protect(st, backend="reference")
    p = subprocess.Popen([sys.executable, "-c", _READER, slot.socket, part], text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    slot.allow(p.pid)
    try:
        assert p.stdout.readline().strip() == "mapped", p.stderr.read()
        c.inject_pages(tier=tier, part=part, group=_gid(c, "a", 1), first=0, count=1)
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGBUS, (out, err)
    assert "read" not in out
