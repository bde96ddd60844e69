"""Device-trace analysis for benchmarks/rmu_overhead.py's `--trace` (CUDA only).

Role: run one callable under torch.profiler and say where the device's time went: per-kernel
device time, the union of device activity against the wall time, every device operation in
order, and the idle gaps with the host CUDA calls that overlapped them.

Calling contract: `kernel_trace(dev, fn)` returns {} off CUDA, else the dict documented there
(rmu_overhead.py stores it as `update_trace` in its JSON).  `union` and `idle_gaps` are pure
functions of (start, end, name, ...) tuples in microseconds, usable without a GPU or torch.
"""
from __future__ import annotations

import time


def kernel_trace(dev, fn, top: int = 14) -> dict:
    """Run fn() once under torch.profiler (CUDA only): device time per kernel/copy name (top
    `top`, ms), the union of all device activity (busy_ms) and the wall time (wall_ms).  Where
    wall exceeds busy the device waited on the host (launch gaps, fences)."""
    if dev.type != "cuda":
        return {}
    import torch
    from torch.profiler import ProfilerActivity, profile
    # the same stream sync as rmu_overhead.sync: fn's work, not earlier work, is what is traced
    torch.cuda.current_stream(dev).synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.current_stream(dev).synchronize()
        wall = time.perf_counter() - t0
    spans, by, host = [], {}, []
    for e in prof.events():
        s, t = e.time_range.start, e.time_range.end
        if e.device_type != torch.autograd.DeviceType.CUDA:
            if e.name.startswith("cu"):          # CUDA runtime / driver calls, as CUPTI sees them
                host.append((s, t, e.name))
            continue
        spans.append((s, t, e.name, getattr(e, "device_resource_id", None)))
        by[e.name[:90]] = by.get(e.name[:90], 0.0) + (t - s) / 1e3
    busy = sum(t - s for s, t in union(spans))
    top_k = dict(sorted(((k, round(v, 3)) for k, v in by.items()), key=lambda kv: -kv[1])[:top])
    t0 = min((x[0] for x in spans), default=0)
    # Every device operation: [start ms, duration ms, stream, name] -- what ran beside what.
    tl = [[round((s - t0) / 1e3, 3), round((t - s) / 1e3, 3), sid, name[:48]]
          for s, t, name, sid in sorted(spans, key=lambda x: (x[0], x[1]))]
    return {"wall_ms": round(wall * 1e3, 2), "busy_ms": round(busy / 1e3, 2), "kernels_ms": top_k,
            "gaps": idle_gaps(spans, host), "timeline": tl}


def union(spans) -> list[tuple[float, float]]:
    """Merged (start, end) intervals of `spans` [(start, end, ...)]."""
    out: list[list[float]] = []
    for s, t, *_ in sorted(spans, key=lambda x: (x[0], x[1])):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return [(s, t) for s, t in out]


def idle_gaps(device, host, min_us: float = 50.0, top: int = 12) -> dict:
    """Where the device waited (pure; times in µs): the idle intervals between the first and
    the last device activity of `device` [(start, end, name)], each >= min_us, the longest
    `top` with the device operations around it and the host's CUDA calls overlapping it
    (`host` [(start, end, name)]: a cudaStreamSynchronize or cudaHostRegister there is the
    host holding the device up; only launches, the host being slower than the device)."""
    if not device:
        return {"idle_ms": 0.0, "count": 0, "longest": []}
    dev = sorted(device, key=lambda d: (d[0], d[1]))
    busy = union(dev)
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_us]
    out = []
    for s, t in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        before = max((d for d in dev if d[1] <= s), key=lambda d: d[1], default=None)
        after = min((d for d in dev if d[0] >= t), key=lambda d: d[0], default=None)
        calls: dict[str, float] = {}
        for hs, ht, name in host:
            o = min(ht, t) - max(hs, s)
            if o > 0:
                calls[name] = calls.get(name, 0.0) + o
        out.append({"at_ms": round((s - dev[0][0]) / 1e3, 3), "ms": round((t - s) / 1e3, 3),
                    "after": before[2][:60] if before else None,
                    "before": after[2][:60] if after else None,
                    "host_calls_ms": {k: round(v / 1e3, 3) for k, v in
                                      sorted(calls.items(), key=lambda kv: -kv[1])[:4]}})
    return {"idle_ms": round(sum(t - s for s, t in gaps) / 1e3, 3), "count": len(gaps),
            "longest": out}
