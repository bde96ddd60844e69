"""Where every node of a multi-node round starts (leto_run.start_plan.decide_start, a pure
function of the nodes' views), the exchange over a real store, and the peer beats
(leto_run.peers.PeerWatch) over a real store with the clock given; the membership probe
(leto_run.membership) over a stuck call."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from leto_run.membership import MembershipProbe
from leto_run.peers import PeerWatch
from leto_run.start_plan import (StartView, announce_fallback, decide_start, exchange,
                                 fallback_announced)
from leto_runtime.control_auth import ForgedControlKey


def V(node, retained=True, resume=None, newest=None, gen=0):
    return StartView(node, retained, resume, newest, gen)


def test_a_node_that_falls_back_takes_every_node_with_it():
    plan = decide_start([V("a", newest="/ck/step_9"), V("b", retained=False, resume="/ck/step_6")])
    assert plan.path == "/ck/step_6" and not plan.stop and "node b" in plan.reason
    # two nodes that fell back: the lowest group rank's checkpoint, on every node
    assert decide_start([V("a", resume="/ck/3"), V("b", resume="/ck/6")]).path == "/ck/3"


def test_a_replacement_node_without_retained_state_makes_every_node_load_the_newest():
    plan = decide_start([V("a", newest="/ck/step_9"), V("b", newest="/ck/step_9"),
                         V("new", retained=False, newest="/ck/step_9", gen=0)])
    assert plan.path == "/ck/step_9" and "new" in plan.reason and "replacement" in plan.reason
    stop = decide_start([V("a"), V("new", retained=False)])
    assert stop.stop and stop.path is None and "no complete checkpoint" in stop.reason


def test_nodes_that_agree_start_as_they_are_at_the_highest_generation():
    same = decide_start([V("a", gen=4), V("b", gen=4)])
    assert same.path is None and not same.stop and "retained" in same.reason
    fresh = decide_start([V("a", retained=False, gen=3), V("b", retained=False, gen=0)])
    assert fresh.path is None and not fresh.stop and fresh.generation == 3


def test_the_views_and_a_fallback_go_through_the_round_s_store():
    store = dist.HashStore()
    mine = V("b", retained=False, resume="/ck/6", gen=2)
    store.set("leto/start/0", '{"node": "a", "retained": true, "resume": null, '
                              '"newest": "/ck/6", "generation": 5}')
    views = exchange(store, 1, 2, mine)
    assert views == [V("a", newest="/ck/6", gen=5), mine]
    assert decide_start(views).generation == 5
    assert fallback_announced(store) is None          # never blocks on the missing key
    announce_fallback(store, "b", "/ck/6")
    assert fallback_announced(store) == {"node": "b", "path": "/ck/6"}


class _Gone:
    """A store whose host is gone: every call fails at once."""

    def set(self, *a):
        raise ConnectionError("connection reset by peer")

    multi_get = set


def _pair(store) -> tuple[PeerWatch, PeerWatch]:
    """Two agents' watchers of one round, started and introduced at time 0."""
    a, b = PeerWatch(store, 0, 5.0, now=0.0), PeerWatch(store, 1, 5.0, now=0.0)
    for w in (a, b):
        w.start()
        w.meet(["n0", "n1"], 0.0)
    return a, b


def test_a_peer_whose_beats_stop_is_lost_after_the_timeout_and_not_before():
    store = dist.HashStore()
    a, b = _pair(store)
    t = 0.0
    while t < 3.0:                        # both beat every 0.5 s
        a.tick(t)
        b.tick(t)
        t += 0.5
    assert a.lost(t) is None and a.heard_since(1.0)
    failure = t
    assert not a.heard_since(failure)     # nothing heard after the failure yet
    b.tick(t)
    a.tick(t)
    b.tick(t + 0.5)
    a.tick(t + 0.5)
    assert a.heard_since(failure)         # b beat after it: alive
    quiet = t + 0.5                        # b's agent is gone from here
    t = quiet
    while t < quiet + 5.0:
        t += 0.5
        a.tick(t)
        assert a.lost(t) is None, t        # silent for at most the timeout: not lost yet
    a.tick(t + 0.6)
    why = a.lost(t + 0.6)
    assert why and "n1 (group rank 1" in why and "--peer-timeout 5 s" in why


def test_a_store_that_stays_unreachable_is_a_lost_node():
    w = PeerWatch(_Gone(), 1, 5.0, now=1.0)
    w.meet(["n0", "n1"], 1.0)
    w.tick(1.0)
    assert w.lost(5.5) is None
    assert "unreachable" in w.lost(6.5) and "connection reset" in w.lost(6.5)


def test_a_peer_whose_workers_succeeded_is_not_lost_while_it_waits_to_exit():
    store = dist.HashStore()
    a, b = _pair(store)
    a.tick(0.5)
    b.tick(0.5)
    b.finish()                 # b's workers succeeded; it is in the exit barrier, silent
    for t in (1.0, 3.0, 6.0, 9.0):
        a.tick(t)
    assert a.lost(9.0) is None
    other = dist.HashStore()
    other.set("leto/alive/1", "0")
    c = PeerWatch(other, 0, 5.0, now=0.0)     # the same silence without the finish: lost
    c.meet(["n0", "n2"], 0.0)
    c.tick(0.5)
    c.tick(6.0)
    assert c.lost(6.0) and "n2" in c.lost(6.0)


def test_after_the_agent_was_away_every_peer_and_the_store_count_from_then():
    """PeerWatch.grace (the agent was stopped: decisions.stall_verdict): a silence the agent
    did not watch is no loss; a peer that stays silent for the timeout after it still is."""
    store = dist.HashStore()
    a, b = _pair(store)
    a.tick(0.5)
    b.tick(0.5)
    assert a.lost(12.0)                    # what a verdict on the stale time would say
    a.grace(12.0)
    assert a.lost(16.5) is None
    assert a.lost(17.5) and "n1" in a.lost(17.5)

    w = PeerWatch(_Gone(), 1, 5.0, now=1.0)
    w.meet(["n0", "n1"], 1.0)
    w.tick(1.0)
    w.grace(20.0)
    assert w.lost(24.0) is None and "unreachable" in w.lost(25.5)


class _Stuck:
    """A store whose host is stopped: every call waits until `go` is set."""

    def __init__(self):
        self.go = threading.Event()

    def set(self, *a):
        assert self.go.wait(30)
        raise ConnectionError("timed out")

    multi_get = check = set


def test_a_store_call_that_does_not_return_counts_as_silence_from_its_start():
    """A stopped store host answers nobody: the store's own timeout (60 s) must not delay the
    verdict, so a call under way is silence from when it began."""
    store = _Stuck()
    w = PeerWatch(store, 1, 5.0, now=1.0)
    w.meet(["n0", "n1"], 1.0)
    t = threading.Thread(target=w.tick, args=(1.0,))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while w.inflight is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert w.lost(5.5) is None
        why = w.lost(6.5)
        assert why and "has not answered for 5.5 s" in why and "--peer-timeout 5 s" in why
        w.grace(20.0)                      # the agent was away meanwhile: counts from then
        assert w.lost(24.0) is None and w.lost(25.5)
    finally:
        store.go.set()
        t.join(10)
    assert w.inflight is None and "unreachable" in w.lost(25.5)


def test_another_node_s_fallback_is_read_by_the_beats_thread_after_the_counters():
    store = dist.HashStore()
    a, b = _pair(store)
    a.tick(0.5)
    assert a.announced() is None
    announce_fallback(store, "n1", "/ck/6")
    assert a.announced() is None           # the loop reads what the thread saw, no store call
    b.tick(1.0)
    a.tick(1.0)
    assert a.announced() == {"node": "n1", "path": "/ck/6"} and a.heard_since(0.5)


def _probe(count, logs):
    return MembershipProbe(count, 0.01, logs.append)


def test_the_membership_count_is_taken_once_and_a_gone_store_is_logged_once():
    logs: list[str] = []
    answers = iter([2, 0, ConnectionError("reset"), ConnectionError("reset"), 1])

    def count():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    p = _probe(count, logs)
    p.read_once()
    p.read_once()
    assert p.take() == 2 and p.take() == 0       # the newest count not yet taken
    p.read_once()
    p.read_once()
    assert p.take() == 0 and p.take() == 0
    assert logs == ["rendezvous store unreachable (ConnectionError: reset)"]
    p.read_once()
    assert p.take() == 1


def test_a_forged_membership_value_is_raised_on_the_agent_s_thread():
    def count():
        raise ForgedControlKey("rdzv/state", "bad MAC")

    p = _probe(count, [])
    p.read_once()
    with pytest.raises(ForgedControlKey):
        p.take()


def test_the_loop_never_waits_for_a_stuck_membership_call():
    go = threading.Event()

    def count():
        assert go.wait(30)
        return 3

    logs: list[str] = []
    p = _probe(count, logs).start()
    try:
        time.sleep(0.1)                          # the thread is inside the call
        t0 = time.monotonic()
        assert p.take() == 0
        assert time.monotonic() - t0 < 0.5
        p.close(join_s=0.2)                      # bounded, and says so
        assert p.thread.is_alive() and "still in a store call" in logs[-1]
    finally:
        go.set()
    p.close(join_s=10)
    assert not p.thread.is_alive() and p.take() == 3


def test_a_fallback_value_that_does_not_parse_is_no_announcement_and_no_lost_store():
    """Only a store that does not answer is silence: a value under the fallback key that is not
    an announcement leaves the beats just read standing."""
    from leto_run.start_plan import FALLBACK_KEY
    store = dist.HashStore()
    a, b = _pair(store)
    for bad in ("{not json", "[1, 2]"):
        store.set(FALLBACK_KEY, bad)
        for t in (1.0, 4.0, 7.0):
            b.tick(t)
            a.tick(t)
        assert a.announced() is None and a.unreachable is None and a.lost(7.0) is None
