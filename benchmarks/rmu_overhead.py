"""RMU steady-state overhead: the paper's Table 1 (docs/BENCHMARKS.md, "RMU steady-state overhead").

Fault-free iteration time, split into the compute phase (forward + backward) and the update
phase (everything from the end of backward to the end of the optimizer step), plus peak GPU
memory, for:

* **reference**: fused `torch.optim.AdamW(fused=True)` after `clip_grad_norm_(foreach=True)`, no
  crash consistency.  Parameters and gradients are views of flat fp32 buffers (as RMU's are), so
  the compute phase is the same program in every variant.
* **sync_snapshot**: the paper's first strawman, here without its parity re-encode (a lower bound
  of its cost): before the optimizer step every iteration copies params, exp_avg and exp_avg_sq to
  pinned host memory and waits for the copy (blocking); counted in the update phase.
* **async_snapshot**: CheckFreq/Gemini-style: right after the optimizer step of t the same copy
  (of the state of t+1) is queued on a side stream, overlapped with the compute of t+1; the update
  of t+1 first waits for it (the state must not change under the copy).  Contention shows in the
  compute phase, a copy longer than the compute in the update phase.
* **rmu**: Leto's Resumable Model Updater for real: the states are retained by a real state
  manager (`SlotHarness`: its own process, CUDA VMM pages held as fds) and mapped into this
  process; parameters and gradients are views of them; each iteration runs `Updater.begin(t)`,
  forward/backward, `Updater.step(t)` (gradient parity, global sync, chunk transactions, parity
  write-back) with activation lending on (`leto_runtime.rmu.lend`).
* **rmu_nolend**: the same with lending off (LETO_LEND=0): what lending saves in memory.
* The default `rmu` path and its alternatives, each one change away from it:
  **rmu_pipelined** (LETO_RMU_UNDO_PIPELINE=1: two undo slots, each chunk's undo copy beside the
  previous chunk's kernel instead of in line), **rmu_inlinewb** (LETO_RMU_WB_OVERLAP=0: each
  group's parity write-back and tier 2 in line, before the next group's chunks; the default
  until 2026-11-30 03:30 UTC),
  **rmu_twokernel** (LETO_RMU_FUSED_SYNDROME=0:
  AdamW writing delta pages, then the batched syndrome delta, instead of cuda/adamw_syndrome.cu;
  one undo slot), **rmu_hostfunc** (LETO_RMU_STREAM_MARKER=hostfunc: marker writes by a host
  function instead of cuda/marker_kernel.cu), **rmu_prev** (two kernels and host-function
  markers: the default until 2026-11-30), and the one kernel's other layouts
  (LETO_RMU_FUSED_LAYOUT): **rmu_f4s** (state-major grid: a tile's three state CTAs adjacent,
  sharing g and the moments through L2), **rmu_f2** (2 KiB tiles: four CTAs per SM instead of
  two), **rmu_f2s** (both).

Each iteration: stream sync, compute, stream sync, update, stream sync (the syncs are the same in
every variant).  Peak GPU memory is device-wide (`cudaMemGetInfo`: total - free, sampled after
every iteration; the caching allocator never returns memory, so the last sample is the peak)
minus the same figure before the variant's model existed: it counts the retained VMM pages
(invisible to torch's allocator statistics) and counts lent memory once (torch's "reserved"
counts RMU's lent ranges a second time).  torch's own max_memory_allocated/reserved are reported
too.  The baselines run in one child process (cache emptied between them), each RMU variant in
its own (one lending pool per process).

    python benchmarks/rmu_overhead.py [--model gpu_1b|small|tiny] [--batch-size B] [--seq T]
        [--accum K] [--warmup W] [--iters N] [--variants a,b,...] [--json FILE] [--md FILE]

--accum K runs K micro-batches per iteration (gradient accumulation): the update phase is the
same, the compute phase K times longer -- how a large global batch puts RMU's fixed update cost
against more compute (the paper's Table 1 has 12.6 s of compute per 47 ms of update).

Default on CUDA: gpu_1b (1.42B parameters), batch 8 x 2048, 3 warm-up + 10 timed iterations.
On CPU (smoke): tiny, batch 4, 1 + 2 iterations, states in host memfd pages; the figures then
mean nothing.  stdout: a Markdown table and one PASS/MISS line per acceptance target.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

GiB = 1 << 30
BASELINES = ("reference", "sync_snapshot", "async_snapshot")
# Environment of each RMU variant's child process (the candidates measured against `rmu`).
RMU_ENV = {"rmu": {}, "rmu_nolend": {"LETO_LEND": "0"},
           "rmu_pipelined": {"LETO_RMU_UNDO_PIPELINE": "1"},
           "rmu_inlinewb": {"LETO_RMU_WB_OVERLAP": "0"},
           "rmu_twokernel": {"LETO_RMU_FUSED_SYNDROME": "0"},
           "rmu_hostfunc": {"LETO_RMU_STREAM_MARKER": "hostfunc"},
           "rmu_prev": {"LETO_RMU_FUSED_SYNDROME": "0", "LETO_RMU_STREAM_MARKER": "hostfunc"},
           # the one-kernel chunk's other layouts (cuda/adamw_syndrome.cu; default 4x2x3)
           "rmu_f4s": {"LETO_RMU_FUSED_LAYOUT": "4x2x3-statemajor"},
           "rmu_f2": {"LETO_RMU_FUSED_LAYOUT": "2x2x3"},
           "rmu_f2s": {"LETO_RMU_FUSED_LAYOUT": "2x2x3-statemajor"}}
ALTERNATIVES = ("rmu_pipelined", "rmu_inlinewb", "rmu_twokernel", "rmu_hostfunc", "rmu_prev",
                "rmu_f4s", "rmu_f2", "rmu_f2s")
ALL = (*BASELINES, *RMU_ENV)


def log(msg: str) -> None:
    print(f"[rmu_overhead] {msg}", file=sys.stderr, flush=True)


def used_bytes(dev) -> int:
    if dev.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(dev)
    return total - free


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def build_model(a, dev):
    from gpt import GPT, GPTConfig
    import dataclasses
    cfg = getattr(GPTConfig, a.model)()
    if a.seq and a.seq != cfg.block_size:
        cfg = dataclasses.replace(cfg, block_size=a.seq)
    with torch.device("meta"):
        model = GPT(cfg)
    return cfg, model


def bind(model, P: torch.Tensor, G: torch.Tensor, layout) -> None:
    """Parameters and gradients become views of the flat buffers (job.py's _materialize)."""
    for slot in layout.params:
        mod_name, _, leaf = slot.name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        p = torch.nn.Parameter(P[slot.offset:slot.offset + slot.numel].view(slot.shape))
        mod._parameters[leaf] = p
        p.grad = G[slot.offset:slot.offset + slot.numel].view(slot.shape)


def init_params(P: torch.Tensor, n: int) -> None:
    g = torch.Generator(device=P.device).manual_seed(0)
    P[:n].normal_(0.0, 0.02, generator=g)


def make_batch(cfg, a, dev, t):
    g = torch.Generator(device="cpu").manual_seed(1000 + t)
    idx = torch.randint(0, cfg.vocab_size, (a.batch_size, cfg.block_size + 1), generator=g)
    return idx[:, :-1].to(dev, non_blocking=True), idx[:, 1:].to(dev, non_blocking=True)


def forward_backward(model, cfg, a, dev, t):
    """The compute phase of iteration t: a.accum micro-batches, gradients accumulated."""
    for k in range(a.accum):
        idx, tgt = make_batch(cfg, a, dev, t * a.accum + k)
        ac = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else \
            torch.autocast("cpu", enabled=False)
        with ac:
            logits, loss = model(idx, tgt)
        del logits                    # nothing but the scalar loss outlives the compute phase
        loss.backward()
    return loss


def adamw_cfg(a):
    from leto_runtime.rmu.adamw import AdamWConfig
    return AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0,
                       warmup_steps=2, total_steps=a.warmup + a.iters + 10)


def kernel_trace(dev, fn, top: int = 14) -> dict:
    """Run fn() once under torch.profiler (CUDA only): device time per kernel/copy name (top
    `top`, ms), the union of all device activity (busy_ms) and the wall time (wall_ms).  Where
    wall exceeds busy the device waited on the host (launch gaps, fences)."""
    if dev.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync(dev)
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


def measure(name, dev, a, begin, compute, update, after=None, extra=None) -> dict:
    times, peak_used = [], 0
    base = a._base_used
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for t in range(a.warmup + a.iters):
        sync(dev)
        t0 = time.perf_counter()
        begin(t)
        compute(t)
        sync(dev)
        t1 = time.perf_counter()
        update(t)
        sync(dev)
        t2 = time.perf_counter()
        if after:
            after(t)
        peak_used = max(peak_used, used_bytes(dev))
        if t >= a.warmup:
            times.append((t1 - t0, t2 - t1))
    comp = [c for c, _ in times]
    upd = [u for _, u in times]
    it = [c + u for c, u in times]
    out = {"variant": name, "iters": len(times),
           "compute_ms": 1e3 * statistics.mean(comp), "update_ms": 1e3 * statistics.mean(upd),
           "iteration_ms": 1e3 * statistics.mean(it),
           "iteration_ms_median": 1e3 * statistics.median(it),
           "update_ms_min": 1e3 * min(upd), "compute_ms_min": 1e3 * min(comp),
           "peak_gpu_gib": (peak_used - base) / GiB if dev.type == "cuda" else None}
    if dev.type == "cuda":
        out["torch_max_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / GiB
        out["torch_max_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / GiB
    out.update(extra or {})
    log(f"{name}: compute {out['compute_ms']:.2f} ms, update {out['update_ms']:.2f} ms, "
        f"peak {out['peak_gpu_gib']} GiB")
    return out


# ---- the baselines ------------------------------------------------------------------------
def run_baselines(a, dev, variants) -> list[dict]:
    import gc
    results, host = [], {"buf": None}
    for name in variants:
        gc.collect()
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        a._base_used = used_bytes(dev)
        results.append(_baseline(a, dev, name, host))
    return results


def _baseline(a, dev, name, hostbuf) -> dict:
    from leto_runtime.rmu.states import Layout
    if True:
        cfg, model = build_model(a, dev)
        layout = Layout.of([(n, tuple(p.shape)) for n, p in model.named_parameters()], 4096)
        P = torch.zeros(layout.nbytes // 4, device=dev)
        G = torch.zeros_like(P)
        init_params(P, layout.numel)
        bind(model, P, G, layout)
        params = list(model.parameters())
        oc = adamw_cfg(a)
        fused = dev.type == "cuda"
        opt = torch.optim.AdamW(params, lr=oc.lr, betas=oc.betas, weight_decay=oc.weight_decay,
                                eps=oc.eps, fused=fused, foreach=None if fused else False)
        # materialize the moments (a snapshot needs them from the first iteration on)
        for p in params:
            st = opt.state[p]
            st["step"] = torch.zeros((), dtype=torch.float32, device=dev if fused else "cpu")
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        srcs = [*(p.detach() for p in params), *(opt.state[p]["exp_avg"] for p in params),
                *(opt.state[p]["exp_avg_sq"] for p in params)]
        total = sum(s.numel() for s in srcs)
        host = hostbuf["buf"]
        if name != "reference" and host is None:
            t0 = time.perf_counter()
            host = hostbuf["buf"] = torch.empty(total, dtype=torch.float32,
                                                pin_memory=dev.type == "cuda")
            log(f"pinned {total * 4 / GiB:.1f} GiB of host memory in {time.perf_counter() - t0:.1f} s")
        elif name == "reference":
            host = None
        dsts = []
        if host is not None:
            off = 0
            for s in srcs:
                dsts.append(host[off:off + s.numel()].view(s.shape))
                off += s.numel()
        side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        pending = {"ev": None}

        def begin(t):
            G.zero_()

        def compute(t):
            forward_backward(model, cfg, a, dev, t)

        def copy_all():
            for s, d in zip(srcs, dsts):
                d.copy_(s, non_blocking=True)

        def update(t):
            if name == "sync_snapshot":
                copy_all()
                sync(dev)
            if name == "async_snapshot" and pending["ev"] is not None:
                torch.cuda.current_stream(dev).wait_event(pending["ev"])
            torch.nn.utils.clip_grad_norm_(params, oc.clip_grad_norm, foreach=True)
            for grp in opt.param_groups:
                grp["lr"] = oc.lr
            opt.step()
            if name == "async_snapshot":
                if side is None:
                    copy_all()
                    return
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    copy_all()
                    pending["ev"] = torch.cuda.Event()
                    pending["ev"].record(side)

        res = measure(name, dev, a, begin, compute, update,
                      extra={"snapshot_gib": total * 4 / GiB if host is not None else 0})
        if side is not None:
            side.synchronize()
        if a.trace and name == "reference":
            t = a.warmup + a.iters
            begin(t)
            compute(t)
            res["update_trace"] = kernel_trace(dev, lambda: update(t))
            log(f"{name}: update trace {dict((k, v) for k, v in res['update_trace'].items() if k != 'timeline')}")
        return res


# ---- RMU under a real state manager -------------------------------------------------------
def run_rmu(a, dev, name) -> dict:
    from leto_run.state_manager import Geometry as SmGeometry
    from leto_run.state_manager.harness import SlotHarness
    from leto_runtime.rmp.client import RmpClient
    from leto_runtime.rmu.marker import Phase
    from leto_runtime.rmu.states import Layout, open_states, pick_chunk_pages
    from leto_runtime.wire.geometry import of_pool
    from leto_runtime.rmu.updater import Updater
    try:
        from rmp_bench import raise_nofile
        raise_nofile()
    except Exception:
        pass
    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    a._base_used = used_bytes(dev)
    geom = SmGeometry(a.data_pages, 16, 1, 2 << 20 if dev.type == "cuda" else 4096)
    slot = SlotHarness(device=str(dev), geometry=geom, ready_timeout=120)
    up = None
    try:
        client = RmpClient(slot.socket, timeout=120)
        geo = of_pool(client.info)        # the pool's groups, its device pages
        page = geo.page_bytes
        cfg, model = build_model(a, dev)
        layout = Layout.of([(n, tuple(p.shape)) for n, p in model.named_parameters()], page)
        chunk = pick_chunk_pages(a.chunk_pages, geo)
        t0 = time.perf_counter()
        ss = open_states(layout, client=client, geo=geo, device=str(dev), chunk_pages=chunk)
        alloc_s = time.perf_counter() - t0
        P, G = ss.flat(ss.model[0]), ss.flat(ss.grads)
        for st in (*ss.model, ss.grads):
            ss.flat(st).zero_()
        init_params(P, layout.numel)
        bind(model, P, G, layout)
        up = Updater(ss, adamw_cfg(a), lend=(name != "rmu_nolend"))
        up.encode_all([*ss.model, ss.grads])
        up.marker.write(initialized=1, t=-1, phase=Phase.DONE)
        log(f"{name}: {layout.numel / 1e9:.2f}B parameters retained in {len(ss.model[0].groups)} "
            f"group(s), chunk {chunk} pages, allocated+mapped in {alloc_s:.1f} s")

        def begin(t):
            up.begin(t)
            G.zero_()

        def compute(t):
            forward_backward(model, cfg, a, dev, t)

        def update(t):
            up.step(t)

        extra = {"retained_gib": sum(st.n_pages * st.page_bytes for st in ss.all
                                     if st.device != "cpu") / GiB,
                 "rmu_buffers_mib": sum(n for _, n in ss.lend_ranges()) / 2**20,
                 "chunk_pages": chunk, "groups": len(ss.model[0].groups)}
        res = measure(name, dev, a, begin, compute, update, extra=extra)
        # One more iteration with the updater's laps on (each syncs the stream): where the
        # update phase goes.  Not part of the timed means above.
        up.profile = {}
        begin(a.warmup + a.iters)
        compute(a.warmup + a.iters)
        sync(dev)
        update(a.warmup + a.iters)
        sync(dev)
        res["update_breakdown_ms"] = {k: round(v, 2) for k, v in sorted(up.profile.items(), key=lambda kv: -kv[1])}
        res["fused_adamw"] = up.fused is not None
        res["fused_syndrome"] = up.fused_syndrome
        if up.fused_syndrome:
            res["fused_layout"] = up.fused.layout
        else:                   # e.g. a layout that failed its self-check: say why
            from leto_runtime.rmu import fused as FZ
            res["fused_syndrome_why_not"] = FZ.why_not_syndrome or FZ.why_not
        res["marker_mode"] = up.marker.mode if up.streamed else "fenced"
        res["undo_slots"] = up.slots
        res["wb_overlap"] = up.wb_overlap
        up.profile = None
        if a.trace:
            t = a.warmup + a.iters + 1
            begin(t)
            compute(t)
            res["update_trace"] = kernel_trace(dev, lambda: update(t))
            log(f"{name}: update trace {dict((k, v) for k, v in res['update_trace'].items() if k != 'timeline')}")
        log(f"{name}: update phase breakdown (ms, profiled iteration): {res['update_breakdown_ms']}; "
            f"fused AdamW kernel: {'on' if up.fused is not None else 'off'}")
        if up.lender is not None:
            st = up.lender.stats()
            res["lend"] = {k: st[k] for k in ("region_bytes", "region_peak", "overflow_peak",
                                              "region_allocs", "overflow_allocs", "lent_iters")}
            res["lend"]["check_ms_per_iter"] = st["check_ms_total"] / max(1, st["lent_iters"])
        return res
    finally:
        if up is not None:
            up.close()
        slot.close()


# ---- orchestration ------------------------------------------------------------------------
def child(a) -> None:
    dev = torch.device("cuda:0" if torch.cuda.is_available() and a.device != "cpu" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    which = a.child.split(",")
    if which[0] in BASELINES:
        out = run_baselines(a, dev, which)
    else:
        out = [run_rmu(a, dev, which[0])]
    print("RESULT " + json.dumps(out), flush=True)


def table(results: list[dict]) -> str:
    ref = next((r for r in results if r["variant"] == "reference"), None)
    rows = ["| variant | compute (ms) | update (ms) | iteration (ms) | vs reference | update vs ref | peak GPU (GiB) |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rel = upd = "--"
        if ref:
            rel = f"{100 * (r['iteration_ms'] / ref['iteration_ms'] - 1):+.2f}%"
            upd = f"{r['update_ms'] / ref['update_ms']:.2f}x"
        pk = "--" if r.get("peak_gpu_gib") is None else f"{r['peak_gpu_gib']:.2f}"
        rows.append(f"| {r['variant']} | {r['compute_ms']:.1f} | {r['update_ms']:.1f} | "
                    f"{r['iteration_ms']:.1f} | {rel} | {upd} | {pk} |")
    return "\n".join(rows)


def verdicts(results: list[dict]) -> list[str]:
    by = {r["variant"]: r for r in results}
    ref, rmu = by.get("reference"), by.get("rmu")
    if not (ref and rmu):
        return []
    out = []
    it = 100 * (rmu["iteration_ms"] / ref["iteration_ms"] - 1)
    phase = ("update" if rmu["update_ms"] - ref["update_ms"] >= rmu["compute_ms"] - ref["compute_ms"]
             else "compute")
    out.append(f"{'PASS' if it <= 0.5 else 'MISS'} RMU adds <= 0.5% to the iteration: {it:+.2f}% "
               f"(compute {rmu['compute_ms'] - ref['compute_ms']:+.1f} ms, update "
               f"{rmu['update_ms'] - ref['update_ms']:+.1f} ms{'' if it <= 0.5 else f'; held back by the {phase} phase'})")
    x = rmu["update_ms"] / ref["update_ms"]
    out.append(f"{'PASS' if x <= 2 else 'MISS'} RMU update <= 2x the reference update: {x:.2f}x "
               f"({rmu['update_ms']:.1f} vs {ref['update_ms']:.1f} ms)")
    out.append(f"INFO rmu (defaults): one-kernel chunk {'on' if rmu.get('fused_syndrome') else 'off'}, marker "
               f"writes {rmu.get('marker_mode')}, {rmu.get('undo_slots')} undo slot(s)")
    for name in ALTERNATIVES:
        ok = by.get(name)
        if ok:
            out.append(f"INFO {name} ({', '.join(f'{k}={v}' for k, v in RMU_ENV[name].items())}; one-kernel chunk "
                       f"{'on' if ok.get('fused_syndrome') else 'off'}, marker writes {ok.get('marker_mode')}, "
                       f"{ok.get('undo_slots')} undo slot(s), write-back overlap "
                       f"{'on' if ok.get('wb_overlap') else 'off'}): "
                       f"update {ok['update_ms']:.1f} ms = {ok['update_ms'] / ref['update_ms']:.2f}x the reference, "
                       f"iteration {100 * (ok['iteration_ms'] / ref['iteration_ms'] - 1):+.2f}%")
    if rmu.get("peak_gpu_gib") is not None:
        d = rmu["peak_gpu_gib"] - ref["peak_gpu_gib"]
        out.append(f"{'PASS' if d <= 0.05 else 'MISS'} peak GPU memory does not grow with RMU: "
                   f"{d:+.2f} GiB vs reference ({rmu['peak_gpu_gib']:.2f} vs "
                   f"{ref['peak_gpu_gib']:.2f} GiB)")
        nl = by.get("rmu_nolend")
        if nl and nl.get("peak_gpu_gib") is not None:
            out.append(f"INFO lending saves {nl['peak_gpu_gib'] - rmu['peak_gpu_gib']:+.2f} GiB of "
                       f"peak GPU memory (RMU buffers {rmu.get('rmu_buffers_mib', 0):.0f} MiB)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None, help="GPTConfig preset (default gpu_1b / tiny)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per iteration (gradient accumulation): the compute phase "
                         "runs this many forward/backward passes, as large global batches do")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (block size)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--data-pages", type=int, default=1024)
    ap.add_argument("--chunk-pages", type=int, default=0)
    ap.add_argument("--variants", default=",".join(ALL))
    ap.add_argument("--trace", action="store_true",
                    help="CUDA: one more update under torch.profiler; per-kernel device time, "
                         "device-busy and wall time of the update phase (update_trace in the JSON)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and a.device != "cpu"
    a.model = a.model or ("gpu_1b" if cuda else "tiny")
    a.batch_size = a.batch_size or (8 if cuda else 4)
    a.warmup = 3 if a.warmup is None and cuda else (1 if a.warmup is None else a.warmup)
    a.iters = a.iters or (10 if cuda else 2)
    if a.child:
        child(a)
        return 0
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in ALL]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {ALL}")
    groups = []
    base = [v for v in variants if v in BASELINES]
    if base:
        groups.append(",".join(base))
    groups += [v for v in variants if v not in BASELINES]
    fwd = ["--device", a.device, "--model", a.model, "--batch-size", str(a.batch_size), "--accum", str(a.accum),
           "--warmup", str(a.warmup), "--iters", str(a.iters), "--data-pages", str(a.data_pages),
           "--chunk-pages", str(a.chunk_pages)] + (["--seq", str(a.seq)] if a.seq else []) + (
        ["--trace"] if a.trace else [])
    results, ok = [], True
    base_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"),
                                                            os.environ.get("PYTHONPATH", "")]))
    for grp in groups:
        env = dict(base_env, **RMU_ENV.get(grp, {}))
        log(f"running {grp} ...")
        p = subprocess.run([sys.executable, __file__, "--child", grp, *fwd], env=env,
                           stdout=subprocess.PIPE, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            log(f"{grp} failed (exit {p.returncode})")
            ok = False
            continue
        results += json.loads(line[len("RESULT "):])
    order = {v: i for i, v in enumerate(ALL)}
    results.sort(key=lambda r: order[r["variant"]])
    md = table(results)
    v = verdicts(results)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
            "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "model": a.model, "batch_size": a.batch_size, "accum": a.accum, "seq": a.seq,
            "warmup": a.warmup, "iters": a.iters}
    print(f"RMU overhead ({a.model}, batch {a.batch_size} x {a.accum} micro-batches, {meta['gpu'] or 'CPU'}, "
          f"{a.iters} timed iterations after {a.warmup})\n\n{md}\n")
    for line in v:
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "results": results, "verdicts": v},
                                           indent=2))
    if a.md:
        Path(a.md).write_text(md + "\n\n" + "\n".join(v) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
