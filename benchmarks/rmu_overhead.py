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
  until 2026-11-30 03:30 UTC), **rmu_unbounded** (LETO_RMU_LOOKAHEAD=0: the host queues every
  chunk without waiting for the GPU, the default until 2026-12-07),
  **rmu_twokernel** (LETO_RMU_FUSED_SYNDROME=0:
  AdamW writing delta pages, then the batched syndrome delta, instead of cuda/adamw_syndrome.cu;
  one undo slot), **rmu_hostfunc** (LETO_RMU_STREAM_MARKER=hostfunc: marker writes by a host
  function instead of cuda/marker_kernel.cu), **rmu_prev** (two kernels and host-function
  markers: the default until 2026-11-30), and the one kernel's layouts unfolded
  (LETO_RMU_FUSED_LAYOUT, with LETO_RMU_FOLD=0: the folded chunk is always the ws kernel): **rmu_f4s** (state-major grid: a tile's three state CTAs adjacent,
  sharing g and the moments through L2), **rmu_f2** (2 KiB tiles: four CTAs per SM instead of
  two), **rmu_f2s** (both), **rmu_ws** (cuda/adamw_ws.cu: one warp-specialized CTA per 2 KiB
  tile for the three states, producer warps feeding Horner warps; `rmu_f4` is the 4x2x3 layout,
  the unfolded path's default), **rmu_fold** (LETO_RMU_FOLD=1: the
  undo copy folded into the ws kernel, leto_runtime/rmu/fold.py; the default since 2026-12-07,
  so `rmu` is the same path).

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

Beside it: rmu_variants.py (the variants, the table and the verdicts), rmu_workload.py (the
model, its batches, the AdamW settings), trace_gaps.py (the analysis behind --trace).
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

from benchmarks.rmu_variants import ALL, BASELINES, RMU_ENV, table, verdicts  # noqa: E402
from benchmarks.rmu_workload import adamw_cfg, build_model, forward_backward, init_params  # noqa: E402
from benchmarks.trace_gaps import kernel_trace  # noqa: E402

GiB = 1 << 30


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


def _torch_adamw(a, dev):
    """The model on flat fp32 buffers (as RMU's are) and torch's AdamW over it, the moments
    materialized.  Returns (cfg, model, G, params, oc, opt): G the flat gradient buffer, oc
    the AdamW settings."""
    from leto_runtime.rmu.states import Layout
    cfg, model = build_model(a, dev)
    layout = Layout.of([(n, tuple(p.shape)) for n, p in model.named_parameters()], 4096)
    P = torch.zeros(layout.nbytes // 4, device=dev)
    G = torch.zeros_like(P)
    init_params(P, layout.numel)
    layout.bind(model, P, G)
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
    return cfg, model, G, params, oc, opt


def _snapshot_dsts(name, dev, srcs, hostbuf):
    """Where a snapshot variant copies `srcs`: views of one host buffer (pinned on CUDA),
    allocated by the first snapshot variant and kept in `hostbuf` for the next; the reference
    gets none.  Returns (the buffer or None, the views, the elements of `srcs`)."""
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
    return host, dsts, total


def _baseline(a, dev, name, hostbuf) -> dict:
    cfg, model, G, params, oc, opt = _torch_adamw(a, dev)
    srcs = [*(p.detach() for p in params), *(opt.state[p]["exp_avg"] for p in params),
            *(opt.state[p]["exp_avg_sq"] for p in params)]
    host, dsts, total = _snapshot_dsts(name, dev, srcs, hostbuf)
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
        trace_update(res, name, dev, a.warmup + a.iters, begin, compute, update)
    return res


def trace_update(res, name, dev, t, begin, compute, update) -> None:
    """One more iteration t, its update phase under torch.profiler: res["update_trace"]."""
    begin(t)
    compute(t)
    res["update_trace"] = kernel_trace(dev, lambda: update(t))
    log(f"{name}: update trace {dict((k, v) for k, v in res['update_trace'].items() if k != 'timeline')}")


# ---- RMU under a real state manager -------------------------------------------------------
def run_rmu(a, dev, name) -> dict:
    from leto_run.state_manager import Geometry as SmGeometry
    from leto_run.state_manager.harness import SlotHarness
    from leto_runtime.rmu.marker import Phase
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
        cfg, model, layout, ss, G, chunk, alloc_s = _retained_model(a, dev, slot)
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
        _describe_update(res, a, dev, name, up, begin, compute, update)
        return res
    finally:
        if up is not None:
            up.close()
        slot.close()


def _retained_model(a, dev, slot):
    """The model with its parameters and gradients views of states retained by the state
    manager behind `slot` (the states zeroed, then the parameters initialized).  Returns
    (cfg, model, layout, ss, G, chunk, alloc_s): ss the StateSet (it holds the client), G the
    flat gradients, chunk the chunk's pages, alloc_s the time to allocate and map the states."""
    from leto_runtime.rmp.client import RmpClient
    from leto_runtime.rmu.states import Layout, open_states, pick_chunk_pages
    from leto_runtime.wire.geometry import of_pool
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
    layout.bind(model, P, G)
    return cfg, model, layout, ss, G, chunk, alloc_s


def _describe_update(res, a, dev, name, up, begin, compute, update) -> None:
    """After the timed iterations, into `res`: the update phase's breakdown from one profiled
    iteration, the updater's configuration, the optional device trace, the lending stats."""
    # One more iteration with the updater's laps on (each syncs the stream): where the
    # update phase goes.  Not part of the timed means.
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
    res["fold"] = up.fold
    res["wb_overlap"] = up.wb_overlap
    up.profile = None
    if a.trace:
        trace_update(res, name, dev, a.warmup + a.iters + 1, begin, compute, update)
    log(f"{name}: update phase breakdown (ms, profiled iteration): {res['update_breakdown_ms']}; "
        f"fused AdamW kernel: {'on' if up.fused is not None else 'off'}")
    if up.lender is not None:
        st = up.lender.stats()
        res["lend"] = {k: st[k] for k in ("region_bytes", "region_peak", "overflow_peak",
                                          "region_allocs", "overflow_allocs", "lent_iters")}
        res["lend"]["check_ms_per_iter"] = st["check_ms_total"] / max(1, st["lent_iters"])


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
