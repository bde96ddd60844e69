"""Failure localization in the state manager: which retained pages can no longer be used.

Role (paper §4.2; docs/MEMORY.md, "Localization"): after a failure and before the promoted
trainer touches retained state, mark every unavailable page as `failed` + `needs_remap`.  Four
sources:

1. **Device pages, from the trainer's probe.**  The state manager has no CUDA context (and
   maps no device memory), so the probe runs in the client, where the pages are mapped:
   cuPointerGetAttribute per page on GPUs, MADV_POPULATE_READ on the CPU stand-in
   (`leto_runtime.rmp.mapping`).  The client sends the failing indices with its request.
2. **Host pages, the real path.**  The state manager maps its own host pages (parity and host
   state, one reserved range per state) and scans each range with MADV_POPULATE_READ,
   bisecting any part that fails with EHWPOISON (or EFAULT).  On kernels without
   CONFIG_MEMORY_FAILURE nothing can be poisoned for real, so this finds nothing there.
3. **The loss registry**: pages that `inject` destroyed (`poisoned` flag: host pages and CPU
   stand-in device pages, truncated), consulted next to the scan and the probe, which see a
   truncated page too; it is what tells a live trainer (`status()["pending_losses"]`).
4. **Pages the pool holds no memory for** (`retired`: an emulated GPU retirement dropped the
   fd).  A trainer that mapped the state *before* the fault (a shadow that pre-attached) still
   maps the old physical page and its probe finds it; the pool knows the page is gone, so it
   is lost whatever that probe says (`RmpClient.refresh` also drops it from such a mapping).

What is scanned when: only what this recovery reads is scanned before the reply -- the parity
of every group with a failed device page, and host-tier states whole.  The rest of the host
pages (the parity of intact groups: ~0.6 GiB for a 20 GiB model, tens of ms of page walks) is
scanned after the reply by a background thread, `DEFER_CHUNK` pages per hold of the pool lock;
a page found lost there is registered, committed and announced on the loss bulletin like any
loss found during training, and the trainer's step-boundary guard repairs it before it reads
that page (`leto_runtime.rmu.guard`).  Nothing is read from an unscanned page in between but by
a parity update, which traps (SIGBUS) on a poisoned page as it would on poison arriving at any
other time: never silently.  A localize that changed no flag commits nothing (the keeper holds
that snapshot already).

Calling contract: `localize(pool, device_failures)` runs with the pool lock held; it validates
the client's indices, persists new marks through the keeper, starts the deferred scan, and
returns every state's marks plus timings.  It never changes memory: `Pool.remap` does.
"""
from __future__ import annotations

import threading
import time

from leto_runtime.wire import protocol as P

DEFER_CHUNK = 16          # host pages the deferred scan probes per hold of the pool lock


def _fail(f) -> bool:
    """Mark a page failed and needing fresh memory; True if that is news."""
    news = not (f.failed and f.needs_remap)
    f.failed = f.needs_remap = True
    return news


def _needed(st, ids: list[int], groups: set[int]) -> tuple[list[int], list[int]]:
    """Scan indices of state `st`'s host pages (`ids`, in scan order) that this recovery reads
    (`now`) and the rest."""
    if st.tier == "host":
        return list(range(len(ids))), []
    want = {pid for gi in groups for pid in st.groups[gi].p1 + st.groups[gi].p2}
    now = [i for i, pid in enumerate(ids) if pid in want]
    return now, [i for i, pid in enumerate(ids) if pid not in want]


def localize(pool, device_failures: dict[str, list[int]]) -> dict:
    meta = pool.meta
    t0 = time.perf_counter()
    changed, groups = False, {}
    for name, idxs in device_failures.items():
        st = pool.state(name)
        if st.tier != "device" or any(not 0 <= i < len(st.data) for i in idxs):
            raise P.BadArgument(f"device failures for {name!r}: indices must be data pages "
                                f"0..{len(st.data) - 1} of a device state")
        for i in idxs:
            changed |= _fail(meta.flag(st.data[i]))
        groups[name] = {gi for gi, g in enumerate(st.groups)
                        if any(g.first <= i < g.first + g.k for i in idxs)}
    t1 = time.perf_counter()
    scanned, later = 0, {}
    for name, (hm, ids) in pool.scan.items():
        now, rest = _needed(meta.states[name], ids, groups.get(name, set()))
        scanned += len(now)
        for i in hm.probe(now) if now else ():     # real path: EHWPOISON / EFAULT
            changed |= _fail(meta.flag(ids[i]))
        if rest:
            later[name] = (hm, rest)
    for f in list(meta.flags.values()):
        if f.poisoned or f.retired:                # the loss registry (injected faults), or the
            changed |= _fail(f)                    # pool holds no memory for it any more
    t2 = time.perf_counter()
    if changed:
        meta.version += 1
        pool._commit()
    t3 = time.perf_counter()
    if later:
        scan_later(pool, later)
    return {"marks": {n: meta.marks(st) for n, st in meta.states.items()},
            "host_pages_scanned": scanned, "host_scan_s": t2 - t1, "mark_s": t1 - t0,
            "commit_s": t3 - t2, "host_pages_deferred": sum(len(r) for _, r in later.values())}


def scan_later(pool, later: dict) -> threading.Thread:
    """Scan `later` ({state: (its HostMapping, scan indices)}) in the background, a chunk per
    hold of the pool lock; a newer scan of the same state supersedes this one's rest.  Also
    how a new state's host pages are first walked (`Pool._scan_map`), so the page tables of
    the state manager's view exist before a localization needs them.  Returns the thread
    (also `pool.deferred_scan`)."""
    epochs = pool.scan_epochs
    mine = {}
    for name in later:
        epochs[name] = mine[name] = epochs.get(name, 0) + 1

    def run() -> None:
        for name, (hm0, idxs) in later.items():
            for lo in range(0, len(idxs), DEFER_CHUNK):
                with pool.lock:
                    cur = pool.scan.get(name)
                    if epochs.get(name) != mine[name] or cur is None or cur[0] is not hm0:
                        break                      # superseded, released or remapped since
                    hm, ids = cur
                    # a page already flagged (the registry: injected, retired) was announced
                    lost = [ids[i] for i in hm.probe(idxs[lo:lo + DEFER_CHUNK])
                            if not pool.meta.flag(ids[i]).any()]
                    if [pid for pid in lost if _fail(pool.meta.flag(pid))]:
                        pool.meta.version += 1
                        pool._commit()
                        pool._announce()
                        pool.log(f"host page(s) of state {name!r} found lost after the "
                                 f"localization: {len(lost)}, announced for repair")

    t = pool.deferred_scan = threading.Thread(target=run, name="leto-deferred-scan", daemon=True)
    t.start()
    return t
