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

Calling contract: `localize(pool, device_failures)` runs with the pool lock held; it validates
the client's indices, persists the marks through the keeper, and returns every state's marks
plus timings.  It never changes memory: `Pool.remap` does.
"""
from __future__ import annotations

import time

from leto_runtime.wire import protocol as P


def localize(pool, device_failures: dict[str, list[int]]) -> dict:
    meta = pool.meta
    t0 = time.perf_counter()
    for name, idxs in device_failures.items():
        st = pool.state(name)
        if st.tier != "device" or any(not 0 <= i < len(st.data) for i in idxs):
            raise P.BadArgument(f"device failures for {name!r}: indices must be data pages "
                                f"0..{len(st.data) - 1} of a device state")
        for i in idxs:
            f = meta.flag(st.data[i])
            f.failed = f.needs_remap = True
    t1 = time.perf_counter()
    scanned = 0
    for hm, ids in pool.scan.values():
        scanned += len(ids)
        for i in hm.probe():                       # real path: EHWPOISON / EFAULT
            f = meta.flag(ids[i])
            f.failed = f.needs_remap = True
    for f in list(meta.flags.values()):
        if f.poisoned:                             # the poison registry (injected faults)
            f.failed = f.needs_remap = True
        if f.retired:                              # the pool holds no memory for it any more:
            f.failed = f.needs_remap = True        # lost, whoever still maps the old page
    t2 = time.perf_counter()
    meta.version += 1
    pool._commit()
    return {"marks": {n: meta.marks(st) for n, st in meta.states.items()},
            "host_pages_scanned": scanned, "host_scan_s": t2 - t1, "mark_s": t1 - t0}
