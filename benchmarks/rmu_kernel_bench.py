"""The RMU chunk kernels alone, on one full-size chunk: which layout of the one-kernel chunk is
fastest, and how far each kernel is from the device's copy bandwidth.

Role: the quick side-by-side that benchmarks/rmu_overhead.py is too slow for (that one builds a
1.42B-parameter model per variant, ~50 s each).  Per run, on one CUDA device, same data:

* **copy**: `torch.Tensor.copy_` of the chunk's three states (params, exp_avg, exp_avg_sq): the
  undo copy RMU makes before each chunk, and the device's practical bandwidth (read + write);
* **adamw**: the fused AdamW kernel (cuda/adamw_cuda.cu) without deltas -- what the update would
  cost without parity (28 bytes per parameter);
* **adamw+deltas, syndrome**: the two-kernel path (AdamW writing the delta pages, then the
  batched syndrome delta over them, `ParityCode.update_delta_many`);
* **onekernel[LAYOUT]**: cuda/adamw_syndrome.cu in each layout (`leto_runtime.rmu.fused.LAYOUTS`),
  each first checked against the two-kernel path on this device (`Fused.syndrome_check`): a
  layout that does not give the same bits is reported and not timed;
* **fold, fold+counts, onecta, onecta-fold, ws, ws-fold** (`fused.BENCH_KERNELS`, kernels the
  updater does not use): the undo copy folded into the chunk (cuda/adamw_fold.cu: the 3 CTAs of
  a tile a cluster; with per-tile stage counts), one CTA per tile for the 3 states
  (cuda/adamw_onecta.cu; cuda/adamw_ws.cu with producer and Horner warps), reading the undo copy
  or folding it in, each checked the same way (and the folding ones against the values before
  the step), next to what they would replace (the undo copy + onekernel[4x2x3]).

Times are CUDA-event means over --reps launches after --warmup; bytes moved are what each kernel
must read and write at least (HBM traffic, parity pages included), so GB/s compares kernels, not
a profiler's count.

Usage (GPU machine): python3 benchmarks/rmu_kernel_bench.py [--pages 256] [--page-mib 2]
    [--k 1024] [--first 768] [--reps 20] [--warmup 3] [--json FILE] [--md FILE]
Exits 2 with a message where there is no CUDA device (nothing to measure on a CPU).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MiB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=256, help="pages per chunk (the updater's default at 2 MiB)")
    p.add_argument("--page-mib", type=int, default=2, help="page size in MiB")
    p.add_argument("--k", type=int, default=1024, help="data pages of the group (1024: the baked mix)")
    p.add_argument("--first", type=int, default=768, help="the chunk's first page in its group")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layouts", default=None, help="comma-separated (default: all)")
    p.add_argument("--bench-kernels", default=None,
                   help="comma-separated among fused.BENCH_KERNELS (default: all; the folding ones "
                        "but ws-fold+counts build the leto_rmu_fold extension)")
    p.add_argument("--json")
    p.add_argument("--md")
    a = p.parse_args(argv)
    if a.first + a.pages > a.k:
        p.error(f"--first {a.first} + --pages {a.pages} exceed the group's {a.k} pages")
    from leto_runtime.rmu.fused import BENCH_KERNELS, LAYOUTS
    bad = [x for x in (a.layouts.split(",") if a.layouts else []) if x not in LAYOUTS]
    if bad:
        p.error(f"--layouts: {', '.join(bad)} not among {', '.join(LAYOUTS)}")
    bad = [x for x in (a.bench_kernels.split(",") if a.bench_kernels else []) if x not in BENCH_KERNELS]
    if bad:
        p.error(f"--bench-kernels: {', '.join(bad)} not among {', '.join(BENCH_KERNELS)}")
    return a


def timed(fn, reps: int, warmup: int) -> float:
    """Mean milliseconds of fn() over `reps` launches (CUDA events on the current stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("rmu_kernel_bench: needs a CUDA device (torch sees none); run it on the GPU machine",
              file=sys.stderr)
        return 2
    from leto_runtime.parity import ParityCode
    from leto_runtime.rmu import fused as F
    from leto_runtime.rmu.adamw import AdamWConfig

    dev = torch.device("cuda")
    S, n = a.page_mib * MiB, a.pages
    E = S // 4
    cfg = AdamWConfig(lr=2.2e-4, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0)
    base = F.Fused.for_device(dev, cfg)
    if base is None:
        print(f"rmu_kernel_bench: the fused AdamW kernel is not available: {F.why_not}", file=sys.stderr)
        return 1
    code = ParityCode(a.k, 16, S, backend="cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    st = [torch.randn(n * E, device=dev, generator=gen), torch.randn(n * E, device=dev, generator=gen) * 1e-3,
          torch.rand(n * E, device=dev, generator=gen) * 1e-6]
    undo = [t.clone() for t in st]
    g = torch.randn(n * E, device=dev, generator=gen) * 1e-2
    coef = torch.tensor(0.5, device=dev)
    q = [torch.randint(0, 256, (16, S), dtype=torch.uint8, device=dev, generator=gen) for _ in range(3)]
    outs = [torch.empty_like(x) for x in q]
    d = [torch.empty(n * E, dtype=torch.int32, device=dev) for _ in range(3)]
    idx = range(a.first, a.first + n)
    step = 7
    chunk_bytes = n * S
    parity_bytes = 3 * 2 * 16 * S          # read Q, write Q' per state
    rows, results = [], {}

    def row(name, ms, nbytes, note=""):
        results[name] = {"ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6, "note": note}
        rows.append(f"| {name} | {ms:.3f} | {nbytes / 1e9:.2f} | {nbytes / ms / 1e6:.0f} | {note} |")

    # (Each timed call restores nothing: AdamW moves the states a little per launch, which does
    # not change a kernel's time; the one-kernel chunk reads the undo copy, which stays fixed.)
    row("copy (undo copy of 3 states)", timed(lambda: [u.copy_(s) for u, s in zip(undo, st)], a.reps, a.warmup),
        2 * 3 * chunk_bytes)
    row("adamw (fused, no deltas)", timed(lambda: base.step_(*st, g, step=step, lr=cfg.lr, coef=coef),
                                          a.reps, a.warmup), 7 * chunk_bytes)
    t_ad = timed(lambda: base.step_(*st, g, step=step, lr=cfg.lr, coef=coef, deltas=d), a.reps, a.warmup)
    row("adamw + delta pages", t_ad, 10 * chunk_bytes)
    dv = [x.view(torch.uint8).view(n, S) for x in d]
    t_syn = timed(lambda: code.update_delta_many(outs, idx, dv, bases=q), a.reps, a.warmup)
    row("syndrome delta (3 states)", t_syn, 3 * chunk_bytes + parity_bytes)
    row("two-kernel chunk (sum)", t_ad + t_syn, 13 * chunk_bytes + parity_bytes)
    names = a.layouts.split(",") if a.layouts else list(F.LAYOUTS)
    for name in names:
        f = F.Fused(base.ext, cfg, base.variant)
        f.layout = F.LAYOUTS[name]
        try:
            bad = f.syndrome_check(dev)
        except Exception as e:          # e.g. an AdamW spelling the one kernel is not compiled for
            bad = f"{type(e).__name__}: {e}"
        label = f"onekernel[{name}]"
        if bad:
            results[label] = {"ms": None, "self_check": bad}
            rows.append(f"| {label} | - | - | - | self-check failed: {bad[:120]} |")
            continue
        ms = timed(lambda: f.chunk_syndrome_(st, undo, g, step=step, lr=cfg.lr, coef=coef, code=code,
                                             first=a.first, outs=outs, bases=q), a.reps, a.warmup)
        # minimum traffic: old p, m, v and g read, new p, m, v written, parity read and written
        row(label, ms, 7 * chunk_bytes + parity_bytes, "bit-identical to the two-kernel path")
    fold_rows(a, base, cfg, dev, st, undo, g, coef, code, outs, q, step, chunk_bytes, parity_bytes, row, results,
              rows)
    report(a, dev, n, S, rows, results)
    return 0


def fold_rows(a, base, cfg, dev, st, undo, g, coef, code, outs, q, step, chunk_bytes, parity_bytes, row, results,
              rows):
    """The benchmarks' alternatives to the undo copy + onekernel[4x2x3] (fused.BENCH_KERNELS),
    each self-checked first, next to that pair."""
    from leto_runtime.rmu import fused as F
    today = results.get("onekernel[4x2x3]", {}).get("ms")
    copy = results["copy (undo copy of 3 states)"]["ms"]
    if today:
        row("copy + onekernel[4x2x3] (today's chunk)", copy + today, 13 * chunk_bytes + parity_bytes)
    ws = results.get("onekernel[ws]", {}).get("ms")
    if ws:
        row("copy + onekernel[ws]", copy + ws, 13 * chunk_bytes + parity_bytes)
    cluster = torch.cuda.get_device_capability(dev)[0] >= 9
    written = [torch.empty_like(t) for t in st]
    page_bytes = st[0].numel() * 4 // a.pages
    prog = torch.zeros(3 * -(-page_bytes // 4096), dtype=torch.int32, device=dev)   # per state and 4 KiB tile
    chosen = a.bench_kernels.split(",") if a.bench_kernels else list(F.BENCH_KERNELS)
    for kernel, what in ((k, F.BENCH_KERNELS[k]) for k in chosen):
        if kernel.startswith("fold") and not cluster:
            rows.append(f"| {kernel} | - | - | - | needs sm_90 (clusters) |")
            continue
        f = F.Fused(base.ext, cfg, base.variant)
        try:
            bad = f.syndrome_check(dev, kernel=kernel)
        except Exception as e:
            bad = f"{type(e).__name__}: {e}"
        if bad:
            results[kernel] = {"ms": None, "self_check": bad}
            rows.append(f"| {kernel} | - | - | - | self-check failed: {bad[:160]} |")
            continue
        folds = kernel not in F.BENCH_READS_UNDO

        def once():
            if kernel == "fold+counts":
                prog.zero_()
            f.chunk_bench_(kernel, st, written if folds else undo, g, step=step, lr=cfg.lr, coef=coef, code=code,
                           first=a.first, outs=outs, bases=q, progress=prog)
        # old p, m, v and g read, new (and with the fold old) p, m, v written, parity read and written
        row(kernel, timed(once, a.reps, a.warmup), (10 if folds else 7) * chunk_bytes + parity_bytes,
            f"bit-identical; {what}")


def report(a, dev, n: int, S: int, rows: list[str], results: dict) -> None:
    """The Markdown table (stdout, --md) and the JSON (--json) of the measured rows."""
    E = S // 4
    meta = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "python": platform.python_version(), "pages": n, "page_bytes": S,
            "k": a.k, "first": a.first, "reps": a.reps, "warmup": a.warmup,
            "parameters_per_chunk": n * E}
    md = "\n".join([f"RMU chunk kernels, one chunk of {n} x {a.page_mib} MiB pages ({n * E / 1e6:.0f}M "
                    f"parameters per state), group k={a.k} at page {a.first}, {meta['gpu']}, "
                    f"{a.reps} launches after {a.warmup}", "",
                    "| kernel | ms | min. traffic (GB) | GB/s | note |", "|---|---|---|---|---|", *rows])
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if a.md:
        Path(a.md).write_text(md + "\n")


if __name__ == "__main__":
    sys.exit(main())
