"""Page loss end to end on CPU: inject faults in a real state manager, localize them by probe,
remap, reconstruct from two-tier parity, and compare with the bytes written before the fault."""
from __future__ import annotations

import numpy as np
import pytest

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.rmp.client import FRESH_FILL, RmpClient
from leto_runtime.rmp.reconstruct import NotRemapped, Unrecoverable, protect, recover, reconstruct

# D=32 (as small as lets 16 + 1 page losses be interesting), H1=16, H2=1, 16 KiB pages
GEOM = Geometry(data_pages=32, tier1=16, tier2=1, page_bytes=16 << 10)
S = GEOM.page_bytes
REF = "reference"          # the NumPy codec: no kernel build on CI (the kernels are tested elsewhere)
N_PAGES = 80                                     # groups of 32, 32 and 16 pages


@pytest.fixture(scope="module")
def slot():
    s = SlotHarness(device="cpu", geometry=GEOM)
    yield s
    s.close()


def write_state(slot, name, seed, n_pages=N_PAGES, kind="model"):
    """Allocate, fill with seeded bytes, encode parity; return (bytes, parity snapshot)."""
    c = RmpClient(slot.socket)
    st = c.allocate(name, n_pages * S, kind=kind)
    data = np.random.default_rng(seed).integers(0, 256, (n_pages, S), dtype=np.uint8)
    st.pages().numpy()[:] = data
    parity = None
    if st.protected:
        protect(st, backend=REF)
        parity = [(st.tier1(g.index).numpy().copy(), st.tier2(g.index).numpy().copy())
                  for g in st.groups]
    c.close()
    return data, parity


def check_exact(st, data, parity):
    assert np.array_equal(st.pages().numpy(), data)
    for g in st.groups:
        assert np.array_equal(st.tier1(g.index).numpy(), parity[g.index][0]), f"tier1 g{g.index}"
        assert np.array_equal(st.tier2(g.index).numpy(), parity[g.index][1]), f"tier2 g{g.index}"


def symbol_domain_parity(data: np.ndarray, m: int) -> np.ndarray:
    """p_i = sum_j G[i][j] * d_j per 16-bit symbol (docs/PARITY.md's generator form): a different
    computation from the codec's syndrome (Horner) path, so it checks the stored parity."""
    from leto_runtime.parity import gf16
    G = gf16.generator(len(data), m)
    sym = gf16.to_symbols(data)
    out = np.zeros((m, sym.shape[1]), dtype=np.uint16)
    for i in range(m):
        for j in range(len(data)):
            out[i] ^= gf16.mul(int(G[i, j]), sym[j])
    return gf16.from_symbols(out)


def gid(slot, name, index):
    return next(s for s in RmpClient(slot.socket).list() if s["name"] == name)["groups"][index]


def test_16_device_pages_plus_one_tier1_page_bit_exact(slot):
    data, parity = write_state(slot, "a", 1)
    c = RmpClient(slot.socket)
    g1 = gid(slot, "a", 1)
    rep = c.inject_pages(tier="device", group=g1, first=5, count=16)      # a DRAM row
    assert rep["emulation"] == "truncated" and [p["index"] for p in rep["pages"]] == list(range(37, 53))
    c.inject_pages(tier="host", group=g1, part="p1", first=3, count=1)
    st = c.attach("a")                               # the promoted trainer maps the pool
    loc, rec = recover(c, backend=REF)
    assert loc.marks["a"].data == list(range(37, 53)) and loc.marks["a"].p1 == {1: [3]}
    assert loc.device_pages_probed == N_PAGES
    assert [(g.index, len(g.data), g.p1) for g in rec.repaired] == [(1, 16, [3])]
    check_exact(st, data, parity)
    assert np.array_equal(st.tier1(1).numpy(), symbol_domain_parity(data[32:64], 16))
    assert not c.localize().failed()                 # marks cleared, nothing left to find
    c.release("a")


def test_17_device_pages_unrecoverable_nothing_overwritten(slot):
    data, parity = write_state(slot, "b", 2)
    c = RmpClient(slot.socket)
    c.inject_pages(tier="device", group=gid(slot, "b", 0), first=10, count=17)
    st = c.attach("b")
    c.localize()
    c.remap()
    with pytest.raises(Unrecoverable) as ei:
        reconstruct(c, backend=REF)
    assert ei.value.code.value == "unrecoverable"
    [g] = ei.value.report.unrecoverable
    assert (g.index, len(g.data), g.tolerance) == (0, 17, 16)
    pages = st.pages().numpy()
    assert (pages[10:27] == FRESH_FILL).all()         # fresh memory, not silently "repaired"
    keep = np.r_[0:10, 27:N_PAGES]
    assert np.array_equal(pages[keep], data[keep])
    for gi in range(3):
        assert np.array_equal(st.tier1(gi).numpy(), parity[gi][0])
    assert st.marks.data == list(range(10, 27))      # marks stay for the fallback to see
    c.release("b")


def test_losses_spread_over_groups_and_both_parity_tiers(slot):
    data, parity = write_state(slot, "c", 3)
    c = RmpClient(slot.socket)
    g0, g1, g2 = (gid(slot, "c", i) for i in range(3))
    c.inject_pages(tier="device", group=g0, first=0, count=3)
    c.inject_pages(tier="host", group=g0, part="p2")                  # tier 2 only: re-encoded
    c.inject_pages(tier="device", group=g1, first=0, count=8)         # 16 in two rows
    c.inject_pages(tier="device", group=g1, first=20, count=8)
    c.inject_pages(tier="device", group=g2, first=11, count=5)        # the short last group
    c.inject_pages(tier="host", group=g2, part="p1", first=0, count=2)  # > H2: tier-1 erasures
    st = c.attach("c")
    loc, rec = recover(c, backend=REF)
    assert sorted((g.index, len(g.data), len(g.p1), len(g.p2)) for g in rec.repaired) == \
        [(0, 3, 0, 1), (1, 16, 0, 0), (2, 5, 2, 0)]
    check_exact(st, data, parity)
    c.release("c")


def test_unprotected_state_is_remapped_without_contents(slot):
    c = RmpClient(slot.socket)
    st = c.allocate("scratch", 4 * S, kind="process")
    assert not st.protected
    st.pages().numpy()[:] = 7
    rep = c.inject_pages(tier="device", state="scratch", first=1, count=2)
    assert len(rep["pages"]) == 2
    loc = c.localize()
    assert loc.marks["scratch"].data == [1, 2] and len(loc.marks["scratch"].unmapped) == 2
    with pytest.raises(NotRemapped):
        reconstruct(c, ["scratch"], backend=REF)
    c.remap(["scratch"])
    assert not st.marks                               # nothing to rebuild: contents undefined
    rec = reconstruct(c, ["scratch"], backend=REF)
    assert [e["index"] for e in rec.undefined] == [1, 2] and not rec.repaired
    pages = st.pages().numpy()
    assert (pages[[0, 3]] == 7).all() and (pages[1:3] == FRESH_FILL).all()
    c.release("scratch")


def test_marks_survive_a_state_manager_crash(slot):
    data, parity = write_state(slot, "d", 4, n_pages=20)
    c = RmpClient(slot.socket)
    c.inject_pages(tier="host", group=gid(slot, "d", 0), part="p1", first=7, count=1)
    c.inject_pages(tier="device", group=gid(slot, "d", 0), first=2, count=4)
    slot.restart()                                    # SIGKILL, then start from the keeper
    c2 = RmpClient(slot.socket)
    st = c2.attach("d")
    loc, rec = recover(c2, backend=REF)
    assert loc.marks["d"].p1 == {0: [7]} and loc.marks["d"].data == [2, 3, 4, 5]
    check_exact(st, data, parity)
    c2.release("d")


def test_inject_spec_fired_like_the_agent_does(slot):
    from leto_run.inject import parse_inject
    from leto_runtime.rmp.faults import fire_pages_spec
    write_state(slot, "e", 5, n_pages=40)
    spec = parse_inject(f"pages:rank=0:group={gid(slot, 'e', 1)}:count=2:tier=device:after=1s")
    rep = fire_pages_spec(slot.socket, spec.to_json()["params"])
    assert rep["emulation"] == "truncated" and [p["index"] for p in rep["pages"]] == [32, 33]
    c = RmpClient(slot.socket)
    c.attach("e")
    loc, rec = recover(c, backend=REF)
    assert loc.marks["e"].data == [32, 33] and rec.pages == 2
    c.release("e")


# ---- a page loss on top of a silent corruption: the repair checks what it decodes against the
# leftover syndromes, corrects what it can locate, stops where it cannot (rmp/verify.py)
def test_a_flipped_parity_bit_beside_a_lost_page_is_corrected(slot):
    data, parity = write_state(slot, "flip-p1", 11)
    c = RmpClient(slot.socket)
    st = c.attach("flip-p1")
    st.tier1(2).numpy()[0, 100] ^= 0x10             # the red team's attack: a parity bit flipped
    c.inject_pages(tier="device", group=gid(slot, "flip-p1", 2), first=5, count=1)
    loc, rec = recover(c, ["flip-p1"], backend=REF)
    assert loc.marks["flip-p1"].data == [64 + 5]
    check_exact(st, data, parity)                   # the lost page and the flipped row
    assert not c.localize().marks["flip-p1"].data


def test_a_flipped_data_bit_beside_a_lost_page_stops(slot):
    """The flipped value may already have been used by the training (the scrub's rule)."""
    data, _ = write_state(slot, "flip-d", 13)
    c = RmpClient(slot.socket)
    st = c.attach("flip-d")
    st.pages().numpy()[64 + 9, 5000] ^= 0x01
    c.inject_pages(tier="device", group=gid(slot, "flip-d", 2), first=5, count=1)
    with pytest.raises(Unrecoverable, match=r"data page\(s\) \[9\]"):
        recover(c, ["flip-d"], backend=REF)
    assert st.pages().numpy()[64 + 9, 5000] == data[64 + 9, 5000] ^ 0x01   # left as found


def test_a_corruption_that_cannot_be_located_stops_the_repair(slot):
    data, parity = write_state(slot, "unlocatable", 12)
    c = RmpClient(slot.socket)
    st = c.attach("unlocatable")
    for r in range(9):                              # nine rows wrong at one symbol: > H1 / 2
        st.tier1(1).numpy()[r, 64] ^= 0xFF
    flipped = st.tier1(1).numpy().copy()
    c.inject_pages(tier="device", group=gid(slot, "unlocatable", 1), first=3, count=1)
    with pytest.raises(Unrecoverable, match="disagree"):
        recover(c, ["unlocatable"], backend=REF)
    assert np.array_equal(st.tier1(1).numpy(), flipped)          # no survivor overwritten
    survivors = [i for i in range(32, 64) if i != 32 + 3]
    assert np.array_equal(st.pages().numpy()[survivors], data[survivors])
    c.remap(["unlocatable"])
