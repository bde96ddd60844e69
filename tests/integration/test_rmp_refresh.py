"""Pre-attached mappings (a shadow attaches while it waits) brought up to date at promotion:
`RmpClient.refresh` re-imports only what changed, at the same addresses, and page loss that
happened after the pre-attach is still found and repaired by localize -> remap -> reconstruct.

CPU: memfd stand-in pages; LETO_SM_FAULT_EMULATION=retire makes device-page faults behave as on
GPUs (the pool drops the fd, live mappings keep the old page)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.wire import protocol as P
from leto_runtime.rmp.client import RmpClient
from leto_runtime.rmp.reconstruct import protect, recover

GEOM = Geometry(data_pages=32, tier1=16, tier2=1, page_bytes=16 << 10)
S = GEOM.page_bytes
REF = "reference"
N = 80                                           # groups of 32, 32 and 16 pages


def _harness(monkeypatch, emulation):
    monkeypatch.setenv("LETO_SM_FAULT_EMULATION", emulation)
    s = SlotHarness(device="cpu", geometry=GEOM)
    s.emulation = emulation
    return s


@pytest.fixture(params=["truncate", "retire"])
def slot(request, monkeypatch):
    s = _harness(monkeypatch, request.param)
    yield s
    s.close()


@pytest.fixture
def retire_slot(monkeypatch):
    """Only GPU-style retirement leaves a stale mapping readable (a truncated stand-in page
    faults in the probe itself, so there is nothing for the safety net to catch)."""
    s = _harness(monkeypatch, "retire")
    yield s
    s.close()


def fill(slot, name="m", seed=1, n=N):
    c = RmpClient(slot.socket)
    st = c.allocate(name, n * S, dtype="uint8", shape=[n * S])
    data = np.random.default_rng(seed).integers(0, 256, (n, S), dtype=np.uint8)
    st.pages().numpy()[:] = data
    protect(st, backend=REF)
    parity = [(st.tier1(g.index).numpy().copy(), st.tier2(g.index).numpy().copy())
              for g in st.groups]
    c.close()
    return data, parity


def exact(st, data, parity) -> bool:
    return np.array_equal(st.pages().numpy(), data) and all(
        np.array_equal(st.tier1(g.index).numpy(), parity[g.index][0]) and
        np.array_equal(st.tier2(g.index).numpy(), parity[g.index][1]) for g in st.groups)


def test_nothing_changed_is_one_round_trip(slot):
    data, parity = fill(slot)
    shadow = RmpClient(slot.socket)
    st = shadow.attach("m")
    view, base = st.tensor(), st.mapping.base
    rep = shadow.refresh()
    assert rep.same == ["m"] and not rep.changed and not rep.reattached and rep.new == []
    assert st.mapping.base == base and st.version == rep.version
    assert np.array_equal(view.numpy().reshape(N, S), data)
    loc = shadow.localize()
    assert loc.failed() == 0
    del view
    shadow.close()


def test_pages_remapped_by_another_trainer_are_reimported_in_place(slot):
    """Active A recovers first (remap + rebuild); the shadow pre-attached before: its mapping of
    the replaced pages is stale (old memory) until refresh maps the new memory, same VA."""
    data, parity = fill(slot)
    shadow = RmpClient(slot.socket)
    st = shadow.attach("m")
    view = st.tensor()
    gid = st.groups[1].id
    a = RmpClient(slot.socket)
    a.inject_pages(tier="device", group=gid, first=3, count=4)
    a.inject_pages(tier="host", group=gid, part="p1", first=2, count=1)
    sa = a.attach("m")
    loc, rep = recover(a, backend=REF)
    assert loc.marks["m"].data == [35, 36, 37, 38] and rep.pages == 5
    assert exact(sa, data, parity)
    del sa
    a.close()
    r = shadow.refresh()
    assert r.changed == {"m": 5} and not r.dropped and not r.reattached
    assert exact(st, data, parity)                            # the rebuilt pages, no SIGBUS
    assert np.array_equal(view.numpy().reshape(N, S), data)   # the old view sees them too
    assert shadow.localize().failed() == 0
    assert shadow.refresh().same == ["m"]                      # caught up
    del view
    shadow.close()


def test_faults_after_pre_attach_are_localized_and_repaired(slot):
    """Pages lost while the shadow waited (nobody recovered yet): refresh, then the usual
    localize -> remap -> reconstruct finds exactly them and rebuilds them in the shadow's
    mapping (GPU emulation: the pre-attached mapping still held the old page)."""
    data, parity = fill(slot)
    shadow = RmpClient(slot.socket)
    st = shadow.attach("m")
    view = st.tensor()
    gid = st.groups[0].id
    injector = RmpClient(slot.socket)
    injector.inject_pages(tier="device", group=gid, first=10, count=16)    # a DRAM row
    injector.inject_pages(tier="host", group=gid, part="p2", first=0, count=1)
    injector.close()
    r = shadow.refresh()
    if slot.emulation == "retire":
        assert r.dropped == {"m": 16}                 # unmapped here: the probe sees them now
        assert sorted(st.probe()) == list(range(10, 26))
    loc, rep = recover(shadow, backend=REF)
    assert loc.marks["m"].data == list(range(10, 26)) and loc.marks["m"].p2 == {0: [0]}
    assert rep.pages == 17
    assert exact(st, data, parity)
    assert np.array_equal(view.numpy().reshape(N, S), data)
    del view
    shadow.close()


def test_retired_pages_are_lost_even_without_refresh(retire_slot):
    """The pool holds no memory for a retired page: localize marks it whatever a stale
    mapping's probe says (the safety net under refresh)."""
    slot = retire_slot
    data, parity = fill(slot)
    shadow = RmpClient(slot.socket)
    st = shadow.attach("m")
    inj = RmpClient(slot.socket)
    inj.inject_pages(tier="device", group=st.groups[2].id, first=0, count=2)
    inj.close()
    assert st.probe() == []                            # the stale mapping still works
    loc = shadow.localize()
    assert loc.marks["m"].data == [64, 65]
    shadow.remap()
    from leto_runtime.rmp.reconstruct import reconstruct
    reconstruct(shadow, backend=REF)
    assert exact(st, data, parity)
    shadow.close()


def test_recreated_and_stale_states_are_reattached_at_the_same_addresses(slot):
    c = RmpClient(slot.socket)
    c.allocate("p", 5 * S, kind="process", dtype="uint8", shape=[5 * S])
    c.allocate("q", 3 * S, kind="process")
    c.close()
    shadow = RmpClient(slot.socket)
    p, q = shadow.attach("p"), shadow.attach("q")
    pv, pbase = p.tensor(), p.mapping.base
    a = RmpClient(slot.socket)
    a.release("p")
    a.allocate("p", 5 * S, kind="process").pages().numpy()[:] = 7   # same layout, new memory
    a.release("q")
    a.allocate("q", 4 * S, kind="process")                         # another layout
    a.allocate("r", S, kind="process")
    a.close(unmap=False)
    r = shadow.refresh()
    assert r.reattached == ["p"] and r.replaced == ["q"] and r.new == ["r"]
    assert r.views_invalid == ["q"]
    assert p is shadow.states["p"] and p.mapping.base == pbase
    assert int(pv.numpy().min()) == 7 == int(pv.numpy().max())     # the old view: new memory
    q2 = shadow.states["q"]
    assert q2 is not q and q2.n_pages == 4
    assert not q.mapped                    # no view of the old object was alive: unmapped
    # many changed pages: re-attach instead of listing them (max_pages)
    a = RmpClient(slot.socket)
    a.inject_pages(tier="device", state="p", first=0, count=3)
    a.attach("p")
    a.localize()
    a.remap()
    a.close()
    r = shadow.refresh(max_pages=2)
    assert "p" in r.reattached and p.mapping.base == pbase
    assert shadow.refresh().same == sorted(shadow.states)
    del pv
    shadow.close()


def test_page_history_survives_a_state_manager_restart(slot):
    data, parity = fill(slot)
    shadow = RmpClient(slot.socket)
    st = shadow.attach("m")
    a = RmpClient(slot.socket)
    a.inject_pages(tier="device", group=st.groups[0].id, first=0, count=2)
    sa = a.attach("m")
    recover(a, backend=REF)
    del sa
    a.close()
    slot.restart()                                   # restored from the keeper's snapshot
    r = shadow.refresh()
    assert r.changed == {"m": 2}
    assert exact(st, data, parity)
    shadow.close()


def raw_call(slot, op: str, **args) -> dict:
    """One request the client's methods would never send, on a connection of its own (as the
    client makes a new one after an error reply), through the wire protocol's public framing."""
    sock = P.connect(slot.socket, deadline=time.monotonic() + 10)
    try:
        deadline = time.monotonic() + P.DEFAULT_CALL_TIMEOUT
        P.send_message(sock, {"op": op, "id": 1, **args}, deadline=deadline)
        return P.raise_for_reply(P.recv_message(sock, deadline=deadline).header)
    finally:
        sock.close()


def test_refresh_arguments_are_checked(slot):
    for bad in ({"states": "x"}, {"states": [{"name": "m"}]},
                {"states": [{"name": "m", "uid": True, "version": 0}]},
                {"states": [], "max_pages": -1},
                {"states": [{"name": "m", "uid": 1, "version": 0}] * 5000}):
        with pytest.raises(P.BadArgument):
            raw_call(slot, "refresh", **bad)
    rep = raw_call(slot, "refresh", states=[{"name": "nope", "uid": 1, "version": 0}])
    assert rep["states"] == {"nope": {"status": "gone"}}
