"""What the step-boundary guard costs a training step: the loss-registry check and the
background scrub (leto_runtime/rmu/guard.py, scrub.py; docs/BENCHMARKS.md, "Scrub").

One process, one model, RMU for real (a state manager holds the retained pages, as in
benchmarks/rmu_overhead.py's `rmu` variant).  Iterations alternate between the guard on
(`Guard.at_boundary(t)` before `Updater.begin(t)`, at the scrub budget given) and off, so both
halves see the same machine at the same moment.  Reported:

* the iteration time of both halves (mean and median) and their difference;
* the scrub's own time (measured inside it) as a share of all the time of the timed
  iterations -- what the budget bounds: its credit accrues over every iteration, and the
  guarded ones spend what the unguarded ones earned too, so a guarded iteration carries about
  twice the budget and the average is the figure to hold against it;
* the same share from the iteration times side by side (guarded minus unguarded, over all);
* the loss check's cost (the loss bulletin: no round trip unless it moved), and the time one
  full pass over the model state takes at the measured rate.

    python benchmarks/scrub_overhead.py [--model gpu_1b|small|tiny] [--accum K] [--budget B]
        [--warmup W] [--iters N] [--json FILE]

Defaults: gpu_1b on CUDA (1.42B parameters, batch 8 x 2048), tiny on CPU (smoke: the figures
then mean little).  The iteration is stream-synchronized at its ends in both halves.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import rmu_overhead as R  # noqa: E402  (model, batches, AdamW settings, device helpers)


def _setup(a, dev):
    from leto_run.state_manager import Geometry as SmGeometry
    from leto_run.state_manager.harness import SlotHarness
    from leto_runtime.rmp.client import RmpClient
    from leto_runtime.rmu.marker import Phase
    from leto_runtime.rmu.states import Layout, open_states, pick_chunk_pages
    from leto_runtime.wire.geometry import of_pool
    from leto_runtime.rmu.updater import Updater
    geom = SmGeometry(a.data_pages, 16, 1, 2 << 20 if dev.type == "cuda" else 4096)
    slot = SlotHarness(device=str(dev), geometry=geom, ready_timeout=120)
    client = RmpClient(slot.socket, timeout=120)
    geo = of_pool(client.info)        # the pool's groups, its device pages
    page = geo.page_bytes
    cfg, model = R.build_model(a, dev)
    layout = Layout.of([(n, tuple(p.shape)) for n, p in model.named_parameters()], page)
    ss = open_states(layout, client=client, geo=geo, device=str(dev),
                     chunk_pages=pick_chunk_pages(0, geo))
    P, G = ss.flat(ss.model[0]), ss.flat(ss.grads)
    for st in (*ss.model, ss.grads):
        ss.flat(st).zero_()
    R.init_params(P, layout.numel)
    layout.bind(model, P, G)
    up = Updater(ss, R.adamw_cfg(a))
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=-1, phase=Phase.DONE)
    return slot, ss, up, cfg, model, G, layout


def run(a) -> dict:
    from leto_runtime.rmu.guard import Guard
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    slot, ss, up, cfg, model, G, layout = _setup(a, dev)
    try:
        guard = Guard(ss, up, scrub_budget=a.budget)
        on, off = [], []
        base = (0.0, 0, 0.0)                   # scrub seconds, checks, check seconds by warm-up end
        for t in range(a.warmup + a.iters):
            if t == a.warmup:
                base = (guard.scrubber.stats.seconds, guard.repairs.checks,
                        guard.repairs.check_seconds)
            R.sync(dev)
            t0 = time.perf_counter()
            if t % 2 == 0:
                guard.at_boundary(t)
            up.begin(t)
            G.zero_()
            R.forward_backward(model, cfg, a, dev, t)
            up.step(t)
            R.sync(dev)
            if t >= a.warmup:
                (on if t % 2 == 0 else off).append(time.perf_counter() - t0)
        sc, rp = guard.scrubber.stats, guard.repairs
        total = sum(on) + sum(off)             # the credit accrues over every iteration
        scrub_s, checks = sc.seconds - base[0], rp.checks - base[1]
        state_bytes = sum((g.k + ss.geo.tier1 + ss.geo.tier2) * ss.geo.page_bytes
                          for st in ss.model for g in st.groups)
        per_s = sc.bytes / max(1e-9, sum(on) + sum(off))
        res = {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "model": a.model, "accum": a.accum, "parameters": layout.numel, "budget": a.budget,
            "iters_each": len(on), "iteration_ms_on": 1e3 * statistics.mean(on),
            "iteration_ms_off": 1e3 * statistics.mean(off),
            "iteration_ms_on_median": 1e3 * statistics.median(on),
            "iteration_ms_off_median": 1e3 * statistics.median(off),
            "scrub_ms_per_guarded_iter": 1e3 * scrub_s / len(on),
            "check_ms": 1e3 * (rp.check_seconds - base[2]) / max(1, checks),
            "slices": sc.slices, "width_bytes": guard.scrubber.width,
            "state_gib": state_bytes / 2**30, "findings": sc.repaired,
            # what the budget bounds: the scrub's time over all the time that earned its credit
            "scrub_share": scrub_s / total,
            # the side-by-side figure: the guarded iterations' extra time, over all iterations
            "growth_share": (sum(on) - statistics.mean(off) * len(on)) / total,
            "full_pass_s": state_bytes / per_s if per_s else None,
        }
        return res
    finally:
        up.close()
        slot.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default="gpu_1b" if cuda else "tiny")
    p.add_argument("--batch-size", type=int, default=8 if cuda else 4)
    p.add_argument("--seq", type=int, default=2048 if cuda else 64)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--data-pages", type=int, default=1024 if cuda else 32)
    p.add_argument("--chunk-pages", type=int, default=0)
    p.add_argument("--budget", type=float, default=0.002)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=20 if cuda else 8)
    p.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res = run(a)
    line = (f"scrub {100 * res['scrub_share']:.3f}% of the time (budget {100 * a.budget:.2f}%), "
            f"guarded iterations {res['iteration_ms_on']:.2f} vs {res['iteration_ms_off']:.2f} ms: "
            f"{100 * res['growth_share']:.3f}% over all iterations; loss check "
            f"{res['check_ms']:.3f} ms; a full pass over {res['state_gib']:.2f} GiB "
            + (f"every {res['full_pass_s']:.0f} s" if res["full_pass_s"] is not None else
               "not estimated: no scrub slice ran in the measured iterations (raise --iters)"))
    print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
