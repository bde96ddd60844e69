"""What a measurement ran on: the machine, the versions, and the Leto code, for the benchmark
reports (launch_overhead.py's JSON; benchmarks/recovery, which also checks by it that two calls
of a continued run measured the same thing).

Calling contract: `machine_info()` -> a flat dict (nproc, cpu, python, torch, leto, leto_tree,
leto_sources, platform) of this repository's checkout; `sources_digest(root)` -> 16 hex digits.
Cheap on purpose (no torch import; git asked with a timeout); what cannot be found is
"unknown" or "not installed".
"""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata


def machine_info() -> dict[str, str | int]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    # What leto-run code was measured: an editable install runs the working tree as it is.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = "unknown"
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--",
                                "leto_run", "leto_runtime"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        dirty = [ln[3:] for ln in dirty if ln.strip()]
        tree = head + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    # Versions from package metadata: importing torch here would cost seconds and memory that
    # the launches would then compete with.
    return {"nproc": os.cpu_count() or 0, "cpu": cpu, "python": platform.python_version(),
            "torch": version("torch"), "leto": version("leto"), "leto_tree": tree,
            "leto_sources": sources_digest(root), "platform": platform.platform()}


def sources_digest(root: str) -> str:
    """sha256 (16 hex digits) of the launcher's, the runtime's and the kernels' source files,
    paths and contents: two measurements with the same digest ran the same code, whatever git
    says (the device's copy of the tree can carry a stale HEAD)."""
    import hashlib
    h = hashlib.sha256()
    for top in ("leto_run", "leto_runtime", "cuda"):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, top))):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".cu", ".cuh", ".h", ".cpp")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()[:16]
