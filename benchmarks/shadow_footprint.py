"""A shadow's resident GPU memory at each preinitialization level, and what cuts L3 (issue 21,
item 4; docs/PREINIT.md).

Each case is a fresh child process that brings itself to one level the way a Leto shadow does
(`leto_runtime.job.Job`: the device set and a tensor made on it -- the CUDA context --, the
runtime's kernels loaded with `leto_runtime.kernels.prepare`, then an NCCL process group of
world size 1 created eagerly with `device_id`, as the shadow forms its generation's group), says
`ready`, and waits.  The parent then reads the child's memory as `nvidia-smi` accounts it
(`--query-compute-apps`, per pid: context, modules, allocator and communicator buffers), takes
the largest of a few samples, and ends the child.  Variants set environment variables known to
size the context or the communicator (module loading, NVLS, cuMem, NCCL buffer sizes) or create
the group lazily (no communicator until the first collective: its cost moves to promotion).

    python -m benchmarks.shadow_footprint [--json F] [--md F]

Needs one CUDA GPU and `nvidia-smi`; exits 2 with the reason otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

CASES = [  # name, level, extra environment, lazy process group
    ("L1", "L1", {}, False),
    ("L2 context only", "L2-context", {}, False),
    ("L2 context only, modules eager", "L2-context", {"CUDA_MODULE_LOADING": "EAGER"}, False),
    ("L2 (context + Leto kernels)", "L2", {}, False),
    ("L3 (as the shadow: eager NCCL)", "L3", {}, False),
    ("L3, NCCL_NVLS_ENABLE=0", "L3", {"NCCL_NVLS_ENABLE": "0"}, False),
    ("L3, NCCL_CUMEM_ENABLE=0", "L3", {"NCCL_CUMEM_ENABLE": "0"}, False),
    ("L3, NCCL_BUFFSIZE=1 MiB", "L3", {"NCCL_BUFFSIZE": str(1 << 20)}, False),
    ("L3, NVLS off + BUFFSIZE 1 MiB + 2 channels", "L3",
     {"NCCL_NVLS_ENABLE": "0", "NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "2"}, False),
    ("L3 lazy (group, no communicator)", "L3", {}, True),
]
READY_S = 300.0


def child(level: str, lazy: bool, store_path: str) -> None:
    import torch
    __import__("leto_runtime")            # a shadow has the runtime imported at every level
    if level != "L1":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
        if level in ("L2", "L3"):
            from leto_runtime import kernels
            kernels.prepare(dev, retained=True)
        if level == "L3":
            import datetime
            import torch.distributed as dist
            kw = {} if lazy else {"device_id": dev}
            dist.init_process_group("nccl", store=dist.FileStore(store_path, 1), rank=0,
                                    world_size=1, timeout=datetime.timedelta(seconds=60), **kw)
        torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.read()                      # until the parent closes it


def _used_mib(pid: int) -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None                       # this sample is missing; the others count
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


def measure(name: str, level: str, env: dict, lazy: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="leto-footprint-") as d:
        p = subprocess.Popen([sys.executable, "-m", "benchmarks.shadow_footprint", "--child",
                              level, "--store", os.path.join(d, "store")]
                             + (["--lazy"] if lazy else []), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **env})
        try:
            t0 = time.monotonic()
            ready, _, _ = select.select([p.stdout], [], [], READY_S)
            line = p.stdout.readline() if ready else ""
            took = time.monotonic() - t0
            if line.strip() != "ready":
                p.kill()
                p.wait()
                why = p.stderr.read() or f"not at {level} within {READY_S:g} s"
                return {"case": name, "error": why[-800:]}
            samples = []
            for _ in range(4):
                time.sleep(0.5)
                samples.append(_used_mib(p.pid))
            got = [s for s in samples if s is not None]
            return {"case": name, "level": level, "env": env, "lazy": lazy,
                    "used_mib": max(got) if got else 0, "ready_s": round(took, 2)}
        finally:
            if p.poll() is None:
                p.stdin.close()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _md(rows: list[dict]) -> str:
    out = ["| case | nvidia-smi MiB | time to level (s) |", "|---|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | failed: {r['error'].splitlines()[-1][:80]} | |")
        else:
            out.append(f"| {r['case']} | {r['used_mib']} | {r['ready_s']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=("L1", "L2-context", "L2", "L3"))
    ap.add_argument("--store")
    ap.add_argument("--lazy", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.lazy, a.store)
        return 0
    import torch
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        print("shadow_footprint: needs a CUDA GPU and nvidia-smi (per-process accounting)",
              file=sys.stderr)
        return 2
    rows = [measure(*c) for c in CASES]
    md = _md(rows)
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "rows": rows}, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
