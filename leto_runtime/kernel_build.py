"""Builds every kernel this machine can use, side by side (`leto-run --build-kernels`, the test
suites' session start).

Role: the orchestration above the kernel cache (`leto_runtime.wire.kernel_cache`).  Each kernel that
has no complete cache slot is built in a child process of its own, all children at once: the
builds are independent (one slot each, each under its slot's flock), and a fresh GPU machine
then waits for the longest build, not their sum.  Child processes rather than threads because
torch's `cpp_extension.load` keeps process-wide state (the compiler from $CXX, its extension
versioner) and imports the module it built.  The parent then loads every kernel itself --
cache hits by then -- so what it reports is what this process can actually load.

Calling contract:
    rows = build_all(cuda=None)       # list[Built]; never raises for a kernel
    for b in rows: print(b.line())    # name, cached | built | skipped | failed, seconds, path/why
`cuda=None` builds the CUDA kernels where torch has CUDA, a toolkit exists and a GPU is visible;
`parallel=False` builds in this process, one after another.  A child that fails is not an error
by itself: the parent's own load then fails with the compiler's message, which is the row's why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from leto_runtime.wire import kernel_cache as K

KERNELS = ("parity_cpu", "parity_cuda", "rmu_cuda", "lend_alloc", "rmp_map")
CUDA_ONLY = frozenset(KERNELS[1:])
CHILD_TIMEOUT = K.LOCK_TIMEOUT + 300.0      # a child may wait out another builder, then build


@dataclass(frozen=True)
class Built:
    """One line of `build_all`: status is cached | built | skipped | failed; `why` says why a
    kernel was skipped or failed ("" otherwise)."""
    name: str
    status: str
    seconds: float
    path: str | None
    why: str = ""

    def line(self) -> str:
        return f"{self.name:<12} {self.status:<8} {self.seconds:6.1f} s  {self.path or self.why}"


def cuda_unavailable() -> str | None:
    """Why this machine cannot use the CUDA kernels, or None when it can."""
    import torch
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) found: install it or set CUDA_HOME"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _loader(name: str) -> tuple[str, Callable[[], object]]:
    """(cache name, loader) of kernel `name`; the loader builds through the cache."""
    from leto_runtime.parity import _ext
    from leto_runtime.rmp import native_map
    from leto_runtime.rmu import fused, lend
    return {"parity_cpu": ("leto_parity_cpu", _ext.load_cpu),
            "parity_cuda": ("leto_parity_cuda", _ext.load_cuda),
            "rmu_cuda": ("leto_rmu_cuda", fused.load),
            "lend_alloc": (lend.NAME, lend.build),
            "rmp_map": (native_map.NAME, native_map.build)}[name]


def load_one(name: str) -> Built:
    """Build (or load from the cache) kernel `name` in this process."""
    lib, fn = _loader(name)
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return Built(name, "failed", time.monotonic() - t0, None, f"{type(e).__name__}: {first}")
    got = K.outcome(lib)
    built = bool(got and got.built)
    return Built(name, "built" if built else "cached",
                 got.seconds if built else time.monotonic() - t0, str(got.path) if got else None)


def _child_env() -> dict[str, str]:
    """The parent's environment, with this copy of leto_runtime first on the path: the child must
    build the same sources the parent will load."""
    here = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)                  # passed on whole, not read as a setting
    path = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": here + (os.pathsep + path if path else "")}


def _build_in_children(names: list[str]) -> dict[str, Built]:
    """Build `names` at once, one child process each; returns the children's rows by name (a
    child that crashed or timed out has none)."""
    cmd = [sys.executable, "-m", "leto_runtime.kernel_build", "--one"]
    env = _child_env()
    procs = {n: subprocess.Popen([*cmd, n], env=env, stdout=subprocess.PIPE, text=True)
             for n in names}
    rows: dict[str, Built] = {}
    deadline = time.monotonic() + CHILD_TIMEOUT
    for n, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            continue
        try:
            rows[n] = Built(**json.loads(out.strip().splitlines()[-1]))
        except (IndexError, ValueError, TypeError):
            pass
    return rows


def build_all(cuda: bool | None = None, parallel: bool = True) -> list[Built]:
    """Build (or find cached) every kernel this machine can use: the C++ parity codec always;
    with `cuda` also the CUDA parity codec, the RMU extension, the lending allocator and the
    native page mapper.  Never raises for a kernel: its row says why it was skipped or failed."""
    skip = cuda_unavailable() if cuda is None else (None if cuda else "not asked for (cuda=False)")
    wanted = [n for n in KERNELS if not (skip and n in CUDA_ONLY)]
    children = _build_in_children(wanted) if parallel and len(wanted) > 1 else {}
    out: list[Built] = []
    for name in KERNELS:
        if name not in wanted:
            out.append(Built(name, "skipped", 0.0, None, skip))
            continue
        mine = load_one(name)
        child = children.get(name)
        if mine.status == "cached" and child is not None and child.status == "built":
            mine = Built(name, "built", child.seconds, mine.path)
        out.append(mine)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--one" or sys.argv[2] not in KERNELS:
        sys.exit(f"usage: python -m leto_runtime.kernel_build --one {{{','.join(KERNELS)}}}")
    print(json.dumps(load_one(sys.argv[2]).__dict__), flush=True)
