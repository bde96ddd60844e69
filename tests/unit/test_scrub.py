"""The background scrub (leto_runtime/rmu/scrub.py) and the boundary repair plan
(leto_runtime/rmu/guard.py), on real CPU states and the real codec.  The independent
expectation is a fresh encode by the NumPy reference backend: what a group's parity must be."""
from __future__ import annotations

import pytest
import torch

from leto_runtime.parity import ParityCode
from leto_runtime.parity.code import ScrubReport
from leto_runtime.rmp.client import Marks
from leto_runtime.rmp.reconstruct import Unrecoverable
from leto_runtime.rmu import adamw as A
from leto_runtime.rmu.guard import plan
from leto_runtime.rmu.scrub import Scrubber, verdict
from leto_runtime.rmu.states import Geometry, Layout, open_states
from leto_runtime.rmu.updater import Updater

S = 4096


def _setup(h1=4, h2=1, data_pages=8):
    geo = Geometry(data_pages, h1, h2, S)
    layout = Layout.of([("w", (20 * S // 4,))], S)       # 20 pages: groups of 8, 8 and 4
    ss = open_states(layout, client=None, geo=geo, device="cpu", chunk_pages=2)
    g = torch.Generator().manual_seed(7)
    for st in ss.model:
        st.pages().copy_(torch.randint(0, 256, (st.n_pages, S), generator=g, dtype=torch.uint8))
    up = Updater(ss, A.AdamWConfig(lr=1e-3), backend="cpu", lend=False)
    up.encode_all(ss.model)
    found = []
    sc = Scrubber(ss, up, budget=1e6, report=lambda kind, **f: found.append(f))
    return ss, up, sc, found


def _sweep(sc, steps=400):
    """Run boundaries until one full pass is done (the budget pays for a slice every time)."""
    start = sc.stats.passes
    for t in range(steps):
        sc.run(t)
        if sc.stats.passes > start:
            return t
    raise AssertionError("no full pass")


def _fresh(ss, st, g):
    gi = st.groups[g]
    ref = ParityCode(gi.k, ss.geo.tier1, S, backend="reference")
    p1 = ref.encode(st.group_pages(g).clone())
    p2 = ParityCode(ss.geo.tier1, ss.geo.tier2, S, backend="reference").encode(p1)
    return p1, p2


def test_a_consistent_state_sweeps_clean_and_covers_every_byte():
    ss, up, sc, found = _setup()
    _sweep(sc)
    assert found == []
    groups = sum(len(st.groups) for st in ss.model)
    assert sc.stats.bytes >= groups * S * (8 + 4 + 1) - 4 * S * 3 * (8 - 4)   # last groups: k=4


@pytest.mark.parametrize("tier", ["p1", "p2"])
def test_a_flipped_parity_bit_is_found_and_reencoded_from_the_data(tier):
    ss, up, sc, found = _setup()
    st = ss.model[1]
    rows = st.tier1(1) if tier == "p1" else st.tier2(1)
    rows[0 if tier == "p2" else 2, 3000] ^= 0x10           # a silent flip, nothing registered
    _sweep(sc)
    assert [f["action"] for f in found] == ["reencode"] and found[0]["group"] == 1
    p1, p2 = _fresh(ss, st, 1)
    assert torch.equal(st.tier1(1), p1) and torch.equal(st.tier2(1), p2)
    assert sc.stats.repaired == 1


def test_a_flipped_data_bit_stops_instead_of_repairing():
    ss, up, sc, found = _setup()
    ss.model[2].group_pages(0)[5, 100] ^= 0x01
    with pytest.raises(Unrecoverable, match="data page"):
        _sweep(sc)
    assert found[-1]["action"] == "unrecoverable"


def test_a_mismatch_one_tier1_row_cannot_locate_stops():
    ss, up, sc, found = _setup(h1=1)
    ss.model[0].tier1(0)[0, 7] ^= 0x80
    with pytest.raises(Unrecoverable, match="cannot be located"):
        _sweep(sc)


def test_the_budget_bounds_the_time_spent():
    """A 10 ms step and a clock on which every reading costs 1 ms (a slice is measured as 1 ms):
    at a 0.2% budget a slice runs about every 40 steps, so the time spent never exceeds the
    budget's share of the time by more than one slice."""
    ss, up, sc, found = _setup()
    now = [0.0]

    def clock():
        now[0] += 0.001
        return now[0]
    sc.clock, sc.budget = clock, 0.002
    for t in range(400):
        now[0] += 0.010
        sc.run(t)
    assert 3 <= sc.stats.slices <= 40
    assert sc.stats.seconds <= 0.002 * now[0] + 0.001 + 1e-9


def _report(consistent, suspects=None, unlocated=0):
    return ScrubReport(consistent, 0 if consistent else 3, suspects or {}, 3, unlocated)


@pytest.mark.parametrize("t1,t2,action", [
    (_report(True), _report(True), "ok"),
    (_report(True), None, "ok"),
    (_report(False, {9: 3}), _report(False, {1: 3}), "reencode"),     # k=8: position 9 is row 1
    (_report(True), _report(False, {4: 3}), "reencode"),              # tier 2 only
    (_report(False, {3: 3}), _report(True), "unrecoverable"),         # a data page
    (_report(False, {9: 2, 3: 1}), _report(True), "unrecoverable"),   # data among the suspects
    (_report(False, {9: 2}, unlocated=1), _report(True), "unrecoverable"),
    (_report(False, {}), _report(True), "unrecoverable"),
])
def test_verdict(t1, t2, action):
    v = verdict(t1, t2, k=8)
    assert v.action == action and v.reason


class _St:
    """A protected state's surface as `plan` reads it."""

    def __init__(self, name, groups, marks, h1=4, h2=1):
        from leto_runtime.rmp.client import GroupInfo
        self.name, self.h1, self.h2, self.marks = name, h1, h2, marks
        self.groups = [GroupInfo(i, i, i * 8, 8) for i in range(groups)]


def test_plan_recomputes_parity_from_data_and_decodes_data_within_tolerance():
    a = _St("a", 3, Marks(data=[], p1={0: [1]}, p2={2: [0]}))
    b = _St("b", 3, Marks(data=[9, 10], p1={1: [0]}))
    c = _St("c", 3, Marks(data=list(range(16, 21)), p1={2: [0, 1]}))        # 5 + 2 > 4
    grads = _St("grads", 3, Marks(data=[1, 2, 3, 4, 5, 6]))
    p = plan([a, b, c, grads], skip=(grads,))
    assert [(st.name, g) for st, g in p.encode] == [("a", 0), ("a", 2)]
    assert [(st.name, loss.index, loss.data) for st, loss in p.decode] == [("b", 1, [9, 10])]
    assert [(loss.state, loss.index) for loss in p.bad] == [("c", 2)]
    assert p.ignored == 6
