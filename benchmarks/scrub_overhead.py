"""What the step-boundary guard costs a training step: the loss-registry check and the
background scrub (leto_runtime/rmu/guard.py, scrub.py; docs/BENCHMARKS.md, "Scrub").

One process, one model, RMU for real (a state manager holds the retained pages, as in
benchmarks/rmu_overhead.py's `rmu` variant).  Iterations alternate between the guard on
(`Guard.at_boundary(t)` before `Updater.begin(t)`, at the scrub budget given) and off, so both
halves see the same machine at the same moment.  Reported:

* the iteration time of both halves (mean and median) and their difference;
* the guard's own time per iteration, measured inside it: the state-manager round trip of the
  loss check, and the scrub's slices -- as a share of the iteration (the budget is 0.2%);
* bytes scrubbed per iteration and the time one full pass over the model state takes at that
  rate (how stale a parity row can get before the scrub reaches it).

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
    from leto_runtime.rmu.states import Geometry, Layout, open_states, pick_chunk_pages
    from leto_runtime.rmu.updater import Updater
    geom = SmGeometry(a.data_pages, 16, 1, 2 << 20 if dev.type == "cuda" else 4096)
    slot = SlotHarness(device=str(dev), geometry=geom, ready_timeout=120)
    client = RmpClient(slot.socket, timeout=120)
    g = client.info["geometry"]
    page = g["page_bytes"]
    gran = (client.info.get("device") or {}).get("granularity")
    if gran:
        page = -(-page // gran) * gran
    geo = Geometry(g["data_pages"], g["tier1"], g["tier2"], page)
    cfg, model = R.build_model(a, dev)
    layout = Layout.of([(n, tuple(p.shape)) for n, p in model.named_parameters()], page)
    ss = open_states(layout, client=client, geo=geo, device=str(dev),
                     chunk_pages=pick_chunk_pages(0, geo))
    P, G = ss.flat(ss.model[0]), ss.flat(ss.grads)
    for st in (*ss.model, ss.grads):
        ss.flat(st).zero_()
    R.init_params(P, layout.numel)
    R.bind(model, P, G, layout)
    up = Updater(ss, R.adamw_cfg(a))
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=-1, phase=Phase.DONE)
    return slot, ss, up, cfg, model, G, layout


def run(a) -> dict:
    from leto_runtime.rmu.guard import Guard
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    slot, ss, up, cfg, model, G, layout = _setup(a, dev)
    try:
        guard = Guard(ss, up, scrub_budget=a.budget)
        on, off = [], []
        for t in range(a.warmup + a.iters):
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
        n_on = (a.warmup + a.iters + 1) // 2
        it = statistics.mean(on + off)
        state_bytes = sum((g.k + ss.geo.tier1 + ss.geo.tier2) * ss.geo.page_bytes
                          for st in ss.model for g in st.groups)
        per_it = sc.bytes / max(1, n_on)
        res = {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "model": a.model, "accum": a.accum, "parameters": layout.numel, "budget": a.budget,
            "iters_each": len(on), "iteration_ms_on": 1e3 * statistics.mean(on),
            "iteration_ms_off": 1e3 * statistics.mean(off),
            "iteration_ms_on_median": 1e3 * statistics.median(on),
            "iteration_ms_off_median": 1e3 * statistics.median(off),
            "scrub_ms_per_iter": 1e3 * sc.seconds / n_on,
            "check_ms_per_iter": 1e3 * rp.check_seconds / max(1, rp.checks),
            "slices": sc.slices, "width_bytes": guard.scrubber.width,
            "scrubbed_mib_per_iter": per_it / 2**20, "state_gib": state_bytes / 2**30,
            "full_pass_iters": state_bytes / per_it if per_it else None,
            "findings": sc.repaired,
        }
        res["scrub_share"] = res["scrub_ms_per_iter"] / (1e3 * it)
        res["guard_share"] = (res["scrub_ms_per_iter"] + res["check_ms_per_iter"]) / (1e3 * it)
        res["full_pass_s"] = (res["full_pass_iters"] or 0) * it * 2      # every other iteration
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
    line = (f"scrub {res['scrub_ms_per_iter']:.3f} ms + loss check {res['check_ms_per_iter']:.3f} "
            f"ms per iteration of {res['iteration_ms_off']:.1f} ms: guard "
            f"{100 * res['guard_share']:.3f}% (scrub {100 * res['scrub_share']:.3f}%, budget "
            f"{100 * a.budget:.2f}%); {res['scrubbed_mib_per_iter']:.2f} MiB per iteration, a "
            f"full pass over {res['state_gib']:.2f} GiB every {res['full_pass_s']:.0f} s; "
            f"iteration on/off {res['iteration_ms_on']:.2f}/{res['iteration_ms_off']:.2f} ms")
    print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
