"""The same DDP script under plain torchrun and under leto-run, side by side (issue: "bring your
own training script", performance).

examples/byo_train.py --ddp (the script's own AdamW + LambdaLR, clipping, two parameter groups,
a frozen sub-module, a tied head) runs without failures under
* `torchrun`: stock DDP and the stock `torch_opt.step()`;
* `leto-run`: the same DDP (its bucketed all-reduce overlapped with backward), then RMU's
  chunk transaction over the retained states (gradient parity, global synchronization,
  per-group update, parity deltas).
Rank 0 records each step's compute phase (forward + backward, DDP's all-reduce included) and
update phase (`opt.step()`).  Modes alternate per repeat, so drift hits both alike; the first
`--warmup` steps and those of the first `--settle` seconds of each run are dropped (under
leto-run the shadows start beside the first steps).  Reported: medians, and leto / torchrun ratios.  The
target: Leto's compute phase equals DDP's (no overlap lost); its update costs what the RMU
overhead benchmark says (benchmarks/rmu_overhead.py).

    python benchmarks/byo_ddp.py [--nproc 2] [--width 384] [--steps 400] [--repeats 3]
                                 [--device cpu|cuda] [--leto-args '...'] [--json F]

stdout is a Markdown table; exit 1 if a run failed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "byo_train.py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_once(mode: str, a, tmp: Path) -> dict:
    timing = tmp / f"{mode}.json"
    args = [SCRIPT, "--ddp", "--steps", str(a.steps), "--width", str(a.width), "--device",
            a.device, "--timing", str(timing)]
    if mode == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(a.nproc), *args]
    else:
        cmd = [sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node",
               str(a.nproc), "--no-status", *a.leto_args.split(), *args]
    p = subprocess.run(cmd, env=_env(), cwd=str(ROOT), capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    t = json.loads(timing.read_text())
    # Steps before `--settle` seconds after the first are dropped: under leto-run the shadows
    # start (import torch, join their group) beside the first steps, on the same cores.
    keep = [i for i, m in enumerate(t["at"]) if i >= a.warmup and m >= t["at"][0] + a.settle]
    if len(keep) < 5:
        raise RuntimeError(f"{mode}: only {len(keep)} steps after the settling time: raise --steps")
    return {k: [t[k][i] for i in keep] for k in ("compute_s", "update_s")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds after the first step whose steps are not counted")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--leto-args", default="",
                    help="extra leto-run options, e.g. a geometry: '--page-bytes 65536 --tier1 2'")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    got: dict[str, dict[str, list[float]]] = {m: {"compute_s": [], "update_s": []}
                                              for m in ("torchrun", "leto-run")}
    try:
        with tempfile.TemporaryDirectory(prefix="leto-byo-ddp-") as d:
            for _ in range(a.repeats):
                for mode in ("torchrun", "leto-run"):
                    r = run_once(mode, a, Path(d))
                    for k in r:
                        got[mode][k] += r[k]
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    med = {m: {k: statistics.median(v) for k, v in got[m].items()} for m in got}
    print(f"| phase | torchrun + DDP (ms) | leto-run + DDP (ms) | leto / torchrun |")
    print("|---|---|---|---|")
    for k, name in (("compute_s", "compute (fwd + bwd + DDP all-reduce)"),
                    ("update_s", "update (opt.step())")):
        t, lt = med["torchrun"][k], med["leto-run"][k]
        print(f"| {name} | {t * 1e3:.2f} | {lt * 1e3:.2f} | {lt / t:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "args": vars(a), "median": med, "samples": got, "machine": platform.node(),
            "python": platform.python_version()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
