"""Recovery time by the preinitialization level the shadows started from (issue 21, item 3;
docs/PREINIT.md), all levels in one run, and what each shadow held on the GPU at its level.

One `leto-run` of examples/byo_train.py moves its shadows L3 -> L1 -> L2 -> L3 (injected
`preinit` changes; the agent relaunches them and the active waits until they are ready) with a
HOF at each level, as tests/integration/test_preinit_levels.py does; the recovery report's
figures of each HOF (`leto_run.report.recoveries`: detection, promotion, the levels brought up,
training resumed) are printed per starting level.  On a GPU every process's device memory is
sampled through NVML (`leto_run.nvml`) during the run: the most each shadow held, by level.  The
first HOF (from L3) strikes before that generation's shadows finished starting on a slow
machine; its row says so (`ready` false) -- the L3 row to read is the last one.

    python -m benchmarks.preinit_recovery [--device cuda] [--width 1024] [--json F]

CPU: two gloo ranks; GPU: world size 1 (NCCL) on the first device.  Exits 2 when leto-run fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = ("kill:rank=0:step=2",
            "preinit:rank=0:step=3:gen=1:level=L1", "kill:rank=0:step=5:gen=1:at=sync",
            "preinit:rank=0:step=6:gen=2:level=L2", "kill:rank=0:step=7:gen=2:at=rmu.update",
            "preinit:rank=0:step=8:gen=3:level=L3", "kill:rank=0:step=10:gen=3")


class Sampler(threading.Thread):
    """NVML every 50 ms: what each pid held on device 0, with the time (`time.monotonic`, the
    events' clock)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        from leto_run.nvml import Nvml
        self.nvml, self.samples, self.stop = Nvml.open(), [], threading.Event()

    def run(self) -> None:
        while self.nvml is not None and not self.stop.wait(0.05):
            try:
                self.samples.append((time.monotonic(), self.nvml.process_bytes(0)))
            except Exception:
                pass

    def most(self, pid: int, until: float = float("inf"), since: float | None = None,
             default: int | None = 0) -> int | None:
        """The most `pid` held in the samples of [since, until); `default` if there are none."""
        return max((got.get(pid, 0) for t, got in self.samples
                    if t < until and (since is None or t >= since)), default=default)


def shadow_memory(sampler: Sampler, evs: list[dict],
                  waiting_after_s: float | None = None) -> dict[str, list[int]]:
    """MiB each fresh shadow held while it was a shadow (until its promotion or exit), by the
    level it reported ready at; with `waiting_after_s`, only from that long after its
    readiness on (what it holds while it waits, its set-up's peak left out; a shadow promoted
    sooner has no such samples and is left out)."""
    out: dict[str, list[int]] = {}
    for e in evs:
        if e["event"] != "spawn" or e.get("role") != "shadow":
            continue
        ready = [x for x in evs if x["event"] == "shadow_ready" and x.get("pid") == e["pid"]]
        if not ready:
            continue                      # killed or promoted before it reached its level
        ends = [x["mono"] for x in evs if x.get("pid") == e["pid"]
                and x["event"] in ("promote", "exit") and x.get("mono") is not None]
        since = None if waiting_after_s is None else ready[0]["mono"] + waiting_after_s
        most = sampler.most(e["pid"], min(ends, default=float("inf")), since,
                            default=None if since is not None else 0)
        if most is not None:
            out.setdefault(ready[0]["level"], []).append(most >> 20)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from leto_run.report import InplaceRecovery, recoveries
    world = 1 if a.device == "cuda" else 2
    tmp = Path(tempfile.mkdtemp(prefix="leto_preinit_bench_"))
    ev = tmp / "events.jsonl"
    cmd = [sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node", str(world),
           "--no-status", "--hang-timeout", "120", "--events", str(ev)]
    for s in SCHEDULE:
        cmd += ["--inject", s.replace("rank=0", f"rank={world - 1}") if "kill" in s else s]
    cmd += [str(ROOT / "examples" / "byo_train.py"), "--steps", "12", "--width", str(a.width),
            "--opt", "adamw", "--device", a.device, "--out", str(tmp / "out")]
    (tmp / "out").mkdir()
    sampler = Sampler() if a.device == "cuda" else None
    if sampler:
        sampler.start()
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.monotonic() - t0
    if sampler:
        sampler.stop.set()
    if p.returncode != 0:
        print(p.stderr[-4000:], file=sys.stderr)
        return 2
    evs = [json.loads(x) for x in ev.read_text().splitlines() if x.strip()]
    rows = []
    for r in recoveries(evs):
        if not isinstance(r, InplaceRecovery):
            continue
        ready = all(e.get("ready") for e in evs if e["event"] == "promote"
                    and e["generation"] == r.generation_from + 1)
        rows.append({"from": r.level, "ready": ready, "detect_s": r.detect_s,
                     "promote_s": r.promote_s, "bringup": dict(r.bringup),
                     "resume_s": r.resume_s, "total_s": r.total_s, "resume": r.resume})
    memory = ({lv: max(v) for lv, v in shadow_memory(sampler, evs).items()} if sampler
              else {})
    print(f"{'from':5} {'ready':5} {'promotion':>10} {'bring-up':>22} {'resumed':>9} {'total':>9}")
    for x in rows:
        up = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in x["bringup"].items()) or "-"
        print(f"{x['from'] or '-':5} {str(x['ready']):5} {x['promote_s'] * 1e3:8.0f}ms "
              f"{up:>22} {x['resume_s'] * 1e3:7.0f}ms {x['total_s'] * 1e3:7.0f}ms")
    if memory:
        print("shadow GPU memory (NVML, most held): "
              + ", ".join(f"{k} {v} MiB" for k, v in sorted(memory.items())))
    if a.json:
        import torch
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "device": (torch.cuda.get_device_name(0) if a.device == "cuda"
                                  else "cpu"), "torch": torch.__version__, "world": world,
                       "width": a.width, "wall_s": wall, "rows": rows,
                       "shadow_mib": memory}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
