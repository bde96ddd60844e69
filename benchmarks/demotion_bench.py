"""Demotion of a HOF's survivors, both ways, side by side (issue 5: "release GPU memory and
become shadows, or are replaced by fresh shadows -- measure both ways").

One schedule, run under `--demote replace` and `--demote release` in the same invocation
(modes interleaved per repeat, so drift hits both alike): `examples/gpt_inplace.py`, 2 ranks;
rank 1 is SIGKILLed in a backward of generation 0 (rank 0 survives), then again `--gap` steps
into generation 1 -- soon, so that rank 0's next shadow may still be starting.  Per mode:

* **demotion**: the agent's demote -> the survivor is gone (replace: its exit) or has released
  (release: its `demoted` datagram).  The promotion waits for this.
* **next shadow ready**: the HOF -> rank 0's shadow of generation 2 reached L3 (replace: a fresh
  process imports torch, sets up the device and joins; release: the same process only joins);
  if the second HOF promoted it before that, the moment it woke up ready.
* **second recovery**: the second HOF's promotion and total time (recovery report), which show
  what an unready shadow costs.
* on GPU, the demoted process's caching-allocator memory before and after it released.

    python benchmarks/demotion_bench.py [--repeats 3] [--steps 14] [--gap 2] [--json F]

Every run must end with exit 0 and bit-identical final digests across modes (the same training);
stdout is a Markdown table, exit 1 if a run failed.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from leto_run.report import recoveries  # noqa: E402

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
MODES = ("replace", "release")


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_once(mode: str, steps: int, first: int, gap: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ev = d / "ev.jsonl"
        cmd = [sys.executable, "-m", "leto_run", "--no-status", "--standalone",
               "--nproc-per-node", "2", "--demote", mode, "--events", str(ev),
               "--log-dir", str(d / "logs"), "--page-bytes", "65536", "--data-pages", "64",
               "--inject", f"kill:rank=1:step={first}:at=backward",
               "--inject", f"kill:rank=1:step={first + gap}:gen=1:at=grads.allreduce",
               SCRIPT, "--steps", str(steps), "--out", str(d)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        t0 = time.monotonic()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                           cwd=str(ROOT))
        wall = time.monotonic() - t0
        if p.returncode != 0:
            raise RuntimeError(f"{mode}: exit {p.returncode}\n{p.stderr[-3000:]}")
        evs = _events(ev)
        digest = json.loads((d / "final_0.json").read_text())["digest"]
    hof = next(e for e in evs if e["event"] == "hof" and e["generation"] == 0)
    asked = [e for e in evs if e["event"] == "demote" and e["generation"] == 0 and e["rank"] == 0]
    if mode == "release":
        done = next(e for e in evs if e["event"] == "demoted" and e["generation"] == 0)
        demote_s = done["agent_seconds"]
        gpu = {k: done.get(k) for k in ("gpu_reserved_before", "gpu_reserved_after")}
    else:
        gone = next(e for e in evs if e["event"] == "exit" and e["generation"] == 0
                    and e.get("rank") == 0 and e.get("collateral"))
        demote_s = gone["mono"] - asked[0]["mono"]
        gpu = {}
    # L3, or its wake-up if the second HOF promoted it before it got there (it then reports
    # `promoted` as soon as it is ready, and no `shadow_ready`).
    ready = min((e for e in evs if e["event"] in ("shadow_ready", "promoted")
                 and e["generation"] == 2 and e["rank"] == 0), key=lambda e: e["mono"])
    recs = recoveries(evs)
    return {"mode": mode, "wall_s": wall, "demote_s": demote_s,
            "next_shadow_ready_s": ready["mono"] - hof.get("failure_mono", hof["mono"]),
            "promotion1_s": recs[0].promote_s, "total1_s": recs[0].total_s,
            "promotion2_s": recs[1].promote_s, "total2_s": recs[1].total_s,
            "digest": digest, **gpu}


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--first", type=int, default=6, help="step of the first HOF")
    ap.add_argument("--gap", type=int, default=2, help="steps from the first to the second HOF")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    runs: list[dict] = []
    for i in range(a.repeats):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            print(f"[demotion_bench] repeat {i + 1}/{a.repeats}: {mode}", file=sys.stderr)
            runs.append(run_once(mode, a.steps, a.first, a.gap, a.timeout))
    digests = {r["digest"] for r in runs}
    if len(digests) != 1:
        print(f"final states differ between runs: {digests}", file=sys.stderr)
        return 1
    keys = ("demote_s", "next_shadow_ready_s", "promotion1_s", "total1_s", "promotion2_s",
            "total2_s")
    med = {m: {k: statistics.median(r[k] for r in runs if r["mode"] == m and r[k] is not None)
               for k in keys} for m in MODES}
    print(f"Demotion, both ways: median of {a.repeats} runs each, {platform.node()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| | replace (SIGKILL + fresh shadow) | release (in process) | replace / release |")
    print("|---|---|---|---|")
    names = {"demote_s": "demotion (promotion waits for it)",
             "next_shadow_ready_s": "HOF -> rank 0's next shadow at L3",
             "promotion1_s": "HOF #1 promotion", "total1_s": "HOF #1 total",
             "promotion2_s": f"HOF #2 ({a.gap} steps later) promotion",
             "total2_s": "HOF #2 total"}
    for k in keys:
        r, s = med["replace"][k], med["release"][k]
        print(f"| {names[k]} | {_ms(r)} | {_ms(s)} | {r / s:.1f}x |" if s else
              f"| {names[k]} | {_ms(r)} | {_ms(s)} | - |")
    gpu = [r for r in runs if r.get("gpu_reserved_before") is not None]
    if gpu:
        print(f"\nGPU caching allocator of a demoted survivor: "
              f"{gpu[0]['gpu_reserved_before'] / 2**20:.0f} MiB reserved before, "
              f"{gpu[0]['gpu_reserved_after'] / 2**20:.0f} MiB after release")
    print("\nEvery run: exit 0, identical final model/optimizer digest across modes.")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
