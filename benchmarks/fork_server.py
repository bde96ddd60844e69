"""What the fork server saves: a whole leto-run job with its workers forked from the fork server
(`LETO_FORK_SERVER=1`, the default: the server a fork of the agent, one `import torch` for the
job, and after it only what the script uses) against the same job with the server preloading
torch._dynamo and DCP anyway (`LETO_FORK_PRELOAD=all`), with the server exec'd
(`LETO_FORK_SERVER=exec`: it imports torch itself, as before the agent forked it) and with
every worker spawned by exec
(`LETO_FORK_SERVER=0`), rotating, same machine, same run.

Per run: the job's wall time and the CPU time of its whole process tree (user + system of every
process the launcher started and waited for, `RUSAGE_CHILDREN` of this driver: the agent
reaps its workers and the driver reaps the agent), how many workers were forked and how the
server started (the job's event log).  The default job is the README's quick start
(`configs/inplace_demo.yaml`: two ranks, three in-place recoveries, so shadows and their
respawns too); `--job "ARGS"` runs `leto-run ARGS` instead (a test-sized job, say).
Calling contract::

    python -m benchmarks.fork_server [--repeats N] [--config FILE | --job ARGS] [--json FILE]

stdout: a Markdown table (median per variant, and the ratios to fork); exit 0 when every
run of the job succeeded, 1 otherwise (the failing run's tail on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import machine_info  # noqa: E402

# (name, the knobs it sets); `fork-preload-all`: the server also imports torch._dynamo and DCP
# whatever the script uses (as every job did before the preload was decided per script)
VARIANTS = (("fork", {"LETO_FORK_SERVER": "1"}),
            ("fork-preload-all", {"LETO_FORK_SERVER": "1", "LETO_FORK_PRELOAD": "all"}),
            ("exec-server", {"LETO_FORK_SERVER": "exec"}), ("exec", {"LETO_FORK_SERVER": "0"}))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(job: list[str], knobs: dict[str, str], work: Path) -> dict:
    ev = work / f"events_{time.monotonic_ns()}.jsonl"
    env = dict(os.environ, **knobs)
    cpu0, t0 = _children_cpu(), time.monotonic()
    p = subprocess.run([sys.executable, "-m", "leto_run", "--no-status", "--events", str(ev),
                        *job], cwd=str(ROOT), env=env, capture_output=True, text=True,
                       timeout=900)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise RuntimeError(f"the job failed with {knobs} (exit {p.returncode})")
    spawns = [json.loads(x) for x in ev.read_text().splitlines() if '"spawn"' in x]
    workers = [e for e in spawns if e.get("role") in ("active", "shadow")]
    server = [e.get("how", "exec") + "".join(f" +{m}" for m in e.get("preload", []))
              for e in spawns if e.get("role") == "fork_server"]
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "workers": len(workers),
            "forked": sum(1 for e in workers if e.get("forked")),
            "server": server[0] if server else "none"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default="configs/inplace_demo.yaml")
    ap.add_argument("--job", help="leto-run's arguments instead of --config's job")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    job = a.job.split() if a.job else ["--config", a.config]
    runs: dict[str, list[dict]] = {name: [] for name, _ in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="fork-bench-") as tmp:
        try:
            for i in range(a.repeats):
                k = i % len(VARIANTS)                   # drift and order cancel
                for name, knob in VARIANTS[k:] + VARIANTS[:k]:
                    runs[name].append(one_run(job, knob, Path(tmp)))
                    print(f"{name} #{i}: {runs[name][-1]}", file=sys.stderr, flush=True)
        except RuntimeError as e:
            print(f"fork_server: {e}", file=sys.stderr)
            return 1
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
           for n, rs in runs.items()}
    m = machine_info()
    print(f"## The fork server: `leto-run {' '.join(job)}`, {a.repeats} runs each "
          f"({m['nproc']} CPUs, {m['cpu']}; torch {m['torch']}; leto at {m['leto_tree']})\n")
    print("| variant | wall (s) | CPU of the process tree (s) | workers (forked) | server |")
    print("|---|---:|---:|---:|---|")
    for n, rs in runs.items():
        print(f"| {n} | {med[n]['wall_s']:.2f} | {med[n]['cpu_s']:.2f} | "
              f"{rs[0]['workers']} ({rs[0]['forked']}) | {rs[0]['server']} |")
    for n in ("fork-preload-all", "exec-server", "exec"):
        print(f"| fork / {n} | {med['fork']['wall_s'] / med[n]['wall_s']:.2f} | "
              f"{med['fork']['cpu_s'] / med[n]['cpu_s']:.2f} | | |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "machine": m, "runs": runs,
                                            "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
