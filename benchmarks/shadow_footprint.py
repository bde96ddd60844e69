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

CASES = [  # name, level, extra environment, child options
    ("L1", "L1", {}, []),
    ("L2 context only", "L2-context", {}, []),
    ("L2 context only, modules eager", "L2-context", {"CUDA_MODULE_LOADING": "EAGER"}, []),
    ("L2 context, stack limit 0", "L2-context", {}, ["--stack", "0"]),
    ("L2 context, stack 0, printf FIFO 0, heap 0", "L2-context", {},
     ["--stack", "0", "--fifo", "0", "--heap", "0"]),
    ("L2 context, module data lazy", "L2-context", {"CUDA_MODULE_DATA_LOADING": "LAZY"}, []),
    ("L2 (context + Leto kernels)", "L2", {}, []),
    ("L3 (as the shadow: eager NCCL)", "L3", {}, []),
    ("L3, stack limit 0 before the group", "L3", {}, ["--stack", "0"]),
    ("L3, stack limit 0 after the group", "L3", {}, ["--stack-after", "0"]),
    ("L3, NCCL_CUMEM_ENABLE=0", "L3", {"NCCL_CUMEM_ENABLE": "0"}, []),
    ("L3, NCCL_MAX_NCHANNELS=2", "L3", {"NCCL_MAX_NCHANNELS": "2"}, []),
    ("L3, NCCL_MAX_NCHANNELS=8", "L3", {"NCCL_MAX_NCHANNELS": "8"}, []),
    ("L3, NCCL_MAX_NCHANNELS=16", "L3", {"NCCL_MAX_NCHANNELS": "16"}, []),
    ("L3, config max_ctas=2", "L3", {}, ["--max-ctas", "2"]),
    ("L3, config max_ctas=1", "L3", {}, ["--max-ctas", "1"]),
    ("L3, stack 0 + config max_ctas=1", "L3", {}, ["--stack", "0", "--max-ctas", "1"]),
    ("L3, NCCL_RUNTIME_CONNECT=1", "L3", {"NCCL_RUNTIME_CONNECT": "1"}, []),
    ("L3, stack 0 + NCCL_MAX_NCHANNELS=2", "L3", {"NCCL_MAX_NCHANNELS": "2"}, ["--stack", "0"]),
    ("L3 lazy (group, no communicator)", "L3", {}, ["--lazy"]),
    ("L3 lazy, stack limit 0", "L3", {}, ["--lazy", "--stack", "0"]),
]
READY_S = 300.0


def _limit(name: str, value: int | None = None) -> int:
    """Read (or set, then read) a limit of the calling thread's current CUDA context."""
    from leto_runtime import ctx_limits
    if value is not None:
        ctx_limits.set_limit(name, value)
    return ctx_limits.get_limit(name)


def child(level: str, a) -> None:
    import torch
    __import__("leto_runtime")            # a shadow has the runtime imported at every level
    info: dict = {}
    if level != "L1":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
        info["default_limits"] = {k: _limit(k) for k in ("stack", "fifo", "heap")}
        for k in ("fifo", "heap", "stack"):
            if getattr(a, k) is not None:
                _limit(k, getattr(a, k))
        if level in ("L2", "L3") and not a.no_kernels:
            from leto_runtime import kernels
            kernels.prepare(dev, retained=True)
        if level == "L3":
            import datetime
            import torch.distributed as dist
            kw = {} if a.lazy else {"device_id": dev}
            if a.max_ctas is not None:
                opts = dist.ProcessGroupNCCL.Options()
                opts.config.max_ctas = a.max_ctas
                kw["pg_options"] = opts
            t = time.monotonic()
            dist.init_process_group("nccl", store=dist.FileStore(a.store, 1), rank=0,
                                    world_size=1, timeout=datetime.timedelta(seconds=60), **kw)
            info["group_s"] = round(time.monotonic() - t, 4)
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        if a.stack_after is not None:
            _limit("stack", a.stack_after)
        torch.cuda.synchronize()
        info["limits"] = {k: _limit(k) for k in ("stack", "fifo", "heap")}
    print("ready " + json.dumps(info), flush=True)
    if sys.stdin.readline().strip() != "promote":
        return                            # the parent closed stdin: done
    # What a promoted shadow would do first: the default stack back, then a collective and a
    # kernel (the lazy communicator is created by its first collective).
    out: dict = {}
    if level != "L1":
        t = time.monotonic()
        if info.get("limits", {}).get("stack") != info["default_limits"]["stack"]:
            _limit("stack", info["default_limits"]["stack"])
        out["restore_s"] = round(time.monotonic() - t, 4)
        x = torch.ones(1 << 20, device="cuda")
        t = time.monotonic()
        if level == "L3":
            import torch.distributed as dist
            dist.all_reduce(x)
        torch.cuda.synchronize()
        out["first_collective_s"] = round(time.monotonic() - t, 4)
        t = time.monotonic()
        (x * 2).sum().item()
        out["first_kernels_s"] = round(time.monotonic() - t, 4)
    print("promoted " + json.dumps(out), flush=True)
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


def _sample(pid: int, n: int = 4) -> int:
    samples = []
    for _ in range(n):
        time.sleep(0.5)
        samples.append(_used_mib(pid))
    got = [s for s in samples if s is not None]
    return max(got) if got else 0


def _line(p, what: str) -> dict | None:
    ready, _, _ = select.select([p.stdout], [], [], READY_S)
    line = p.stdout.readline() if ready else ""
    if not line.startswith(what + " "):
        return None
    return json.loads(line[len(what) + 1:])


def measure(name: str, level: str, env: dict, opts: list, no_kernels: bool = False) -> dict:
    opts = opts + (["--no-kernels"] if no_kernels else [])
    with tempfile.TemporaryDirectory(prefix="leto-footprint-") as d:
        p = subprocess.Popen([sys.executable, "-m", "benchmarks.shadow_footprint", "--child",
                              level, "--store", os.path.join(d, "store")] + opts,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        try:
            t0 = time.monotonic()
            info = _line(p, "ready")
            took = time.monotonic() - t0
            if info is None:
                p.kill()
                p.wait()
                why = p.stderr.read() or f"not at {level} within {READY_S:g} s"
                return {"case": name, "error": why[-800:]}
            used = _sample(p.pid)
            p.stdin.write("promote\n")
            p.stdin.flush()
            after = _line(p, "promoted") or {}
            return {"case": name, "level": level, "env": env, "opts": opts, "used_mib": used,
                    "ready_s": round(took, 2), **info, **after,
                    "promoted_mib": _sample(p.pid, 2)}
        finally:
            if p.poll() is None:
                p.stdin.close()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _md(rows: list[dict]) -> str:
    out = ["| case | nvidia-smi MiB | time to level (s) | group (s) | limits back (ms) | "
           "first collective (ms) | MiB once promoted |", "|---|---:|---:|---:|---:|---:|---:|"]
    ms = lambda v: "" if v is None else f"{1e3 * v:.1f}"    # noqa: E731
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | failed: {r['error'].splitlines()[-1][:80]} | | | | | |")
        else:
            out.append(f"| {r['case']} | {r['used_mib']} | {r['ready_s']} | "
                       f"{r.get('group_s', '')} | {ms(r.get('restore_s'))} | "
                       f"{ms(r.get('first_collective_s'))} | {r['promoted_mib']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=("L1", "L2-context", "L2", "L3"))
    ap.add_argument("--store")
    ap.add_argument("--lazy", action="store_true")
    for k in ("stack", "stack-after", "fifo", "heap", "max-ctas"):
        ap.add_argument("--" + k, type=int)
    ap.add_argument("--cases", help="only the cases whose name this regular expression finds")
    ap.add_argument("--no-kernels", action="store_true",
                    help="skip Leto's kernels (they add nothing nvidia-smi shows; no build)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a)
        return 0
    import torch
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        print("shadow_footprint: needs a CUDA GPU and nvidia-smi (per-process accounting)",
              file=sys.stderr)
        return 2
    import re
    rows = [measure(*c, no_kernels=a.no_kernels) for c in CASES
            if not a.cases or re.search(a.cases, c[0])]
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
