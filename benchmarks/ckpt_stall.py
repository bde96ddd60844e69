"""What a checkpoint costs the training step: Leto's shadow snapshot against DCP async.

Side by side in one run, on the recovery harness's model and train.py (`--preset`), no
failures, the same checkpoint interval (`--every` steps) for every system that checkpoints:

  leto-off       leto-run in place, the script's torch AdamW (`--opt torch`), no checkpoints
  leto-shadow    the same + --checkpoint-dir/--checkpoint-every (writer auto: rank 0's shadow
                 copies retained memory while the active computes)
  leto-trainer   the same with --checkpoint-writer trainer (the active copies to host itself)
  torch-off      torchrun, train.py --mode ref (stock torch, no checkpoints)
  dcp-async      torchrun, train.py --mode dcp --ckpt async (DCP's async save from the trainer)

The step time is the interval between the starts of consecutive steps of rank 0 (it holds
everything the loop waits for: a checkpoint's copy before the step, the wait at the update),
averaged over the steps after `--warmup`; a system's checkpoint overhead is its mean against
its own "off" run.  Each checkpointing run's log says when its checkpoints completed.

    python -m benchmarks.ckpt_stall --preset h200 --steps 200 --every 60 --out /tmp/cs
    python -m benchmarks.ckpt_stall --preset cpu-smoke --steps 40 --every 10 --out /tmp/cs

Writes `<out>/ckpt_stall.json` (every run's step times and checkpoints) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from benchmarks.launch_overhead import launcher_cmd
from benchmarks.provenance import machine_info
from benchmarks.recovery import presets as P
from benchmarks.recovery.systems import TRAIN, train_args

SYSTEMS = ("leto-off", "leto-shadow", "leto-trainer", "torch-off", "dcp-async")
BASELINE = {"leto-shadow": "leto-off", "leto-trainer": "leto-off", "dcp-async": "torch-off"}


def command(name: str, preset: P.Preset, run: str, steps: int, every: int) -> list[str]:
    out, ck = os.path.join(run, "steps"), os.path.join(run, "ckpt")
    common = ["--standalone", "--nproc-per-node", str(preset.nproc)]
    if name.startswith("leto"):
        cmd = launcher_cmd("leto-run") + common + [
            "--no-status", "--events", os.path.join(run, "events.jsonl"), "--recovery",
            "inplace", *preset.leto_args]
        if name != "leto-off":
            cmd += ["--checkpoint-dir", ck, "--checkpoint-every", str(every),
                    "--checkpoint-keep", "1",
                    "--checkpoint-writer", "auto" if name == "leto-shadow" else "trainer"]
        return cmd + [TRAIN, "--mode", "leto", "--opt", "torch", "--steps", str(steps),
                      *train_args(preset, out)]
    cmd = launcher_cmd("torchrun") + common + [TRAIN, *train_args(preset, out),
                                               "--steps", str(steps)]
    if name == "torch-off":
        return cmd + ["--mode", "ref"]
    return cmd + ["--mode", "dcp", "--ckpt", "async", "--ckpt-every", str(every),
                  "--ckpt-dir", ck]


def step_times(run: str, warmup: int) -> dict:
    """Rank 0's step-start intervals after `warmup` steps, and when checkpoints completed."""
    path = os.path.join(run, "steps", "steps_0.jsonl")
    recs = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
    steps = sorted((r for r in recs if r["ev"] == "step"), key=lambda r: r["step"])
    t0 = [r["t0"] for r in steps]
    gaps = [b - a for a, b in zip(t0, t0[1:])][warmup:]
    out = {"steps": len(steps), "gaps": gaps, "t0": t0,
           "mean_s": statistics.fmean(gaps) if gaps else None,
           "median_s": statistics.median(gaps) if gaps else None,
           "max_s": max(gaps) if gaps else None}
    ev = os.path.join(run, "events.jsonl")
    if os.path.exists(ev):
        phases = [json.loads(x) for x in open(ev)]
        out["checkpoints"] = [{k: e.get(k) for k in ("step", "by", "staging", "copy_s",
                                                     "host_s", "host_at", "write_s", "mono",
                                                     "seconds", "error")}
                              for e in phases if e.get("event") == "phase"
                              and e.get("phase") == "checkpoint"]
        out["waits"] = [e.get("seconds") for e in phases if e.get("event") == "phase"
                        and e.get("phase") == "checkpoint_snapshot"]
    else:
        out["checkpoints"] = [r for r in recs if r["ev"] == "ckpt_done"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-smoke", choices=sorted(P.PRESETS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--budget", type=float, default=None, help="seconds for all runs")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    preset = P.get(a.preset)
    names = [n for n in a.systems.split(",") if n]
    bad = [n for n in names if n not in SYSTEMS]
    if bad:
        p.error(f"unknown system(s) {bad}: choose from {', '.join(SYSTEMS)}")
    os.makedirs(a.out, exist_ok=True)
    end = time.monotonic() + a.budget if a.budget else None
    results, env = {}, {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for name in names:
        if end is not None and time.monotonic() > end:
            results[name] = {"skipped": "the budget ran out"}
            continue
        run = os.path.join(a.out, name)
        shutil.rmtree(run, ignore_errors=True)
        os.makedirs(run)
        t0 = time.monotonic()
        with open(os.path.join(run, "launcher.log"), "wb") as log:
            try:
                rc = subprocess.run(command(name, preset, run, a.steps, a.every), env=env,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        results[name] = {"rc": rc, "wall_s": time.monotonic() - t0,
                         **step_times(run, a.warmup)}
        shutil.rmtree(os.path.join(run, "ckpt"), ignore_errors=True)   # 13 GB each on the H200
        print(f"{name}: rc={rc} wall {results[name]['wall_s']:.0f} s, mean step "
              f"{_ms(results[name]['mean_s'])}", flush=True)
        table = _dump(a, preset, results)      # after every run: a cut-short call keeps them
    table = _dump(a, preset, results)
    for name, row in table.items():
        print(f"{name:13s} mean step {_ms(row['mean_s'])} vs {row['baseline']} "
              f"{_ms(row['baseline_mean_s'])}: {row['overhead_pct']:+.2f}%  "
              f"(worst step {_ms(row['max_s'])}, checkpoints {row['checkpoints']})")
    return 0 if all(r.get("rc") == 0 for r in results.values() if "skipped" not in r) else 1


def _dump(a, preset: P.Preset, results: dict) -> dict:
    table = overheads(results)
    with open(os.path.join(a.out, "ckpt_stall.json"), "w") as f:
        json.dump({"machine": machine_info(),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "preset": preset.name, "steps": a.steps, "every": a.every,
                   "warmup": a.warmup, "runs": results, "overhead": table}, f, indent=1)
    return table


def overheads(results: dict) -> dict:
    """Each checkpointing system's mean step time against its own off run's."""
    table = {}
    for name, base in BASELINE.items():
        r, b = results.get(name, {}), results.get(base, {})
        if r.get("mean_s") and b.get("mean_s"):
            table[name] = {"mean_s": r["mean_s"], "baseline": base,
                           "baseline_mean_s": b["mean_s"], "max_s": r["max_s"],
                           "overhead_pct": 100.0 * (r["mean_s"] / b["mean_s"] - 1.0),
                           "checkpoints": len(r.get("checkpoints") or [])}
    return table


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
