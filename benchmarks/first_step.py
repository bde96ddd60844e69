"""What a fresh trainer's first step costs, and what a waiting shadow could warm (issue 22, item 3).

The recovery harness (docs/BENCHMARKS.md, 2026-12-06) showed the promoted trainer's first step
at 2.4-2.7x the steady step -- and a fresh trainer's step 0 at the same figure: it is the first
step of any process.  This measures, for the harness's model in fresh processes (one per
variant and repeat, so nothing is warm), the first step and the steady one after a warm-up that
a waiting shadow could run, with what each warm-up costs in time and device memory:

* **cold**: nothing warmed (what a promoted shadow pays today);
* **blas**: the cuBLAS handle and a bf16 matmul under autocast (cuBLAS/cuBLASLt set-up, their
  workspaces) -- no model involved;
* **fwd**: one forward of the model under `torch.no_grad()` on a batch of 1 x `--warm-tokens`
  tokens (loads the forward's kernels; writes no parameter -- what a shadow could run on its
  pre-attached, read-only view of the retained weights);
* **fwd_full**: the same forward at the real batch shape (the GEMM shapes of the first step)
  -- its activations are what it costs;
* **step**: a whole step (forward, backward, optimizer) on a private model of one batch of
  1 x `--warm-tokens` tokens: the upper bound of warming without the real shapes (a shadow
  cannot run it: its gradients and moments would be the retained state's);
* **eager**: `CUDA_MODULE_LOADING=EAGER` (every module at context creation).

Per variant: warm-up seconds, device memory the warm-up added (`torch.cuda.memory_reserved` and,
where the driver lists pids, NVML's per-process figure), first step and the median of the next
`--steps` steps (synchronized), and their ratio.  On a CPU machine the same runs on the CPU
(ratios only; blas/eager are no-ops there).  Calling contract::

    python -m benchmarks.first_step [--model gpu_1b] [--n-layer 18] [--block-size 1024]
        [--batch-size 8] [--variants cold,blas,fwd,fwd_full,step,eager] [--repeats 2]
        [--steps 3] [--warm-tokens 16] [--json FILE]

stdout: a Markdown table; exit 0 when every run completed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("cold", "blas", "fwd", "fwd_full", "step", "eager")

CHILD = r"""
import json, os, statistics, sys, time
sys.path[:0] = [os.path.join(sys.argv[1], "examples"), sys.argv[1]]
import dataclasses, torch
from gpt import GPT, GPTConfig, batch, init_weights
a = json.loads(sys.argv[2])
cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
cfg = dataclasses.replace(getattr(GPTConfig, a["model"])(),
                          **{k: v for k, v in a["over"].items() if v})
def sync():
    if cuda:
        torch.cuda.synchronize()
def held():
    if not cuda:
        return 0, None
    try:
        from leto_run.nvml import Nvml
        nv = Nvml.open()
        mine = nv.process_bytes(nv.physical(0)).get(os.getpid()) if nv else None
    except Exception:
        mine = None
    return torch.cuda.memory_reserved(), mine
import contextlib
auto = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
model = GPT(cfg).to(dev)
init_weights(model, 0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
if cuda:
    torch.zeros(1, device=dev)                   # the context, as a shadow at L2 has it
sync()
r0, n0 = held()
t0 = time.perf_counter()
v = a["variant"]
small = dataclasses.replace(cfg, block_size=min(cfg.block_size, a["warm_tokens"]))
if v == "blas" and cuda:
    torch.cuda.current_blas_handle()
    with auto():
        (torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)).sum().item()
elif v in ("fwd", "fwd_full"):
    bs, c = (1, small) if v == "fwd" else (a["batch_size"], cfg)
    idx, tgt = batch(0, 0, 0, bs, c, dev)
    with torch.no_grad(), auto():
        model(idx, tgt)
elif v == "step":
    twin = GPT(small).to(dev)
    o2 = torch.optim.AdamW(twin.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
    idx, tgt = batch(0, 0, 0, 1, small, dev)
    with auto():
        _, loss = twin(idx, tgt)
    loss.backward()
    o2.step()
    del twin, o2, loss
sync()
warm_s = time.perf_counter() - t0
r1, n1 = held()
times = []
for t in range(1 + a["steps"]):
    idx, tgt = batch(0, t, 0, a["batch_size"], cfg, dev)
    sync()
    s0 = time.perf_counter()
    with auto():
        _, loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    sync()
    times.append(time.perf_counter() - s0)
print("RESULT " + json.dumps({"warm_s": warm_s, "reserved_mib": (r1 - r0) / 2**20,
      "nvml_mib": None if n0 is None or n1 is None else (n1 - n0) / 2**20,
      "first_s": times[0], "steady_s": statistics.median(times[1:]),
      "device": torch.cuda.get_device_name(0) if cuda else "cpu"}))
"""


def run_one(a, variant: str) -> dict:
    env = dict(os.environ)
    if variant == "eager":
        env["CUDA_MODULE_LOADING"] = "EAGER"
    spec = {"model": a.model, "over": {"n_layer": a.n_layer, "block_size": a.block_size},
            "batch_size": a.batch_size, "steps": a.steps, "warm_tokens": a.warm_tokens,
            "variant": variant}
    p = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), json.dumps(spec)], env=env,
                       capture_output=True, text=True, timeout=a.timeout, cwd=str(ROOT))
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"{variant}: exit {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(line[-1][7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpu_1b")
    ap.add_argument("--n-layer", type=int, default=18)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warm-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or a.repeats < 1 or a.steps < 1 or a.warm_tokens < 2:
        ap.error(f"variants from {','.join(VARIANTS)} (got {bad}); repeats, steps >= 1; "
                 "warm-tokens >= 2")
    rows = {}
    for v in variants:
        rows[v] = []
        for i in range(a.repeats):
            rows[v].append(run_one(a, v))
            print(f"{v} #{i}: {rows[v][-1]}", file=sys.stderr, flush=True)
    dev = next(iter(rows.values()))[0]["device"]
    print(f"## First step of a fresh trainer by warm-up ({a.model}, {a.n_layer} layers, "
          f"block {a.block_size}, batch {a.batch_size}; {dev}; medians of {a.repeats})\n")
    print("| warm-up | warm-up (s) | memory it added (MiB: reserved / NVML) | first step (ms) "
          "| steady step (ms) | first / steady |")
    print("|---|---:|---:|---:|---:|---:|")
    med = lambda v, k: statistics.median(r[k] for r in rows[v])    # noqa: E731
    for v in variants:
        nv = [r["nvml_mib"] for r in rows[v] if r["nvml_mib"] is not None]
        mem = f"{med(v, 'reserved_mib'):.0f} / {statistics.median(nv):.0f}" if nv \
            else f"{med(v, 'reserved_mib'):.0f} / -"
        print(f"| {v} | {med(v, 'warm_s'):.3f} | {mem} | {1e3 * med(v, 'first_s'):.1f} | "
              f"{1e3 * med(v, 'steady_s'):.1f} | {med(v, 'first_s') / med(v, 'steady_s'):.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
