"""The state manager's localization scans before its reply only the host pages the recovery
reads (the parity of groups with a failed device page, host-tier states whole); the rest is
scanned after the reply, and a loss found there is registered, committed and announced on the
loss bulletin (`leto_run/state_manager/localize.py`).  A real pool of memfd pages in this
process, real truncation (a lost page as the kernel sees it, *not* entered in the loss
registry), real MADV_POPULATE_READ scans: the oracle is which pages were truncated.  Also: a
new state's host pages are walked once in the background when it is allocated, and a loss
there is found by that walk."""
from __future__ import annotations

import os
import time

from leto_run.state_manager import Geometry
from leto_run.state_manager.localize import localize
from leto_run.state_manager.metadata import PoolMeta
from leto_run.state_manager.pages import MemfdPages
from leto_run.state_manager.pool import Pool
from leto_runtime.wire import bulletin

GEOM = Geometry(data_pages=4, tier1=2, tier2=1, page_bytes=4096)


def _pool(tmp_path) -> Pool:
    board = bulletin.Writer(str(tmp_path / "sm.sock.losses"))
    pool = Pool(PoolMeta(GEOM, GEOM.page_bytes), MemfdPages("device", sealed=False),
                log=lambda m: None, bulletin=board)
    with pool.lock:
        pool.allocate("w", 12 * GEOM.page_bytes, "model", True, "device", None, None, False)
    pool.deferred_scan.join(30)      # the new state's host pages, walked once in the background
    assert not pool.deferred_scan.is_alive() and pool.pending_losses() == 0
    return pool


def _flags(pool, pid):
    f = pool.meta.flags.get(pid)
    return bool(f and f.failed and f.needs_remap)


def _wait(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "the deferred scan did not finish in time"
        time.sleep(0.01)


def test_only_the_needed_parity_is_scanned_before_the_reply_and_the_rest_after(tmp_path):
    pool = _pool(tmp_path)
    st = pool.meta.states["w"]
    assert len(st.groups) == 3
    lost_far = st.groups[2].p1[0]                # a group no device page of this failure is in
    lost_near = st.groups[0].p2[0]               # the failed device page's group
    for pid in (lost_far, lost_near):
        os.ftruncate(pool.fds[pid], 0)           # gone for every mapping; not in the registry
    before, version = pool.bulletin.value(), pool.meta.version
    with pool.lock:
        rep = localize(pool, {"w": [1]})         # data page 1 (group 0) failed on the device
    parity = sum(len(g.p1) + len(g.p2) for g in st.groups)
    assert rep["host_pages_scanned"] == len(st.groups[0].p1) + len(st.groups[0].p2)
    assert rep["host_pages_deferred"] == parity - rep["host_pages_scanned"]
    assert rep["marks"]["w"]["data"] == [1]
    assert rep["marks"]["w"]["p2"] == {"0": [0]}          # found before the reply
    assert _flags(pool, lost_near) and pool.meta.version == version + 1
    _wait(lambda: _flags(pool, lost_far))                  # found after it, and announced
    _wait(lambda: pool.bulletin.value() > before)
    assert pool.pending_losses() == 3
    assert {pid for pid, f in pool.meta.flags.items() if f.failed} == \
        {st.data[1], lost_near, lost_far}


def test_a_localize_with_nothing_new_commits_nothing_and_a_clean_deferred_scan_is_silent(tmp_path):
    pool = _pool(tmp_path)
    commits = []
    pool._commit = lambda *a, **k: commits.append(a)       # count the keeper commits only
    before, version = pool.bulletin.value(), pool.meta.version
    with pool.lock:
        rep = localize(pool, {})
    assert rep["host_pages_scanned"] == 0 and rep["host_pages_deferred"] > 0
    assert rep["marks"]["w"] == {"data": [], "p1": {}, "p2": {}, "unmapped": []}
    pool.deferred_scan.join(30)                            # it ran to its end, found nothing
    assert not pool.deferred_scan.is_alive()
    assert commits == [] and pool.meta.version == version
    assert pool.bulletin.value() == before and pool.pending_losses() == 0


def test_a_new_state_s_host_pages_are_walked_once_in_the_background(tmp_path):
    pool = _pool(tmp_path)
    with pool.lock:
        st, _ = pool.allocate("v", 8 * GEOM.page_bytes, "model", True, "device", None, None,
                              False)
        os.ftruncate(pool.fds[st.groups[1].p1[1]], 0)   # lost before its first walk
        before = pool.bulletin.value()
    pool.deferred_scan.join(30)
    assert _flags(pool, st.groups[1].p1[1]) and pool.bulletin.value() > before
    assert pool.pending_losses() == 1
