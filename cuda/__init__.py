"""Leto's native kernel sources (C++ and CUDA), shipped as package data of the package `leto_cuda`.

Role: this folder holds sources only -- nothing here is compiled at install time.  The runtime
finds them through `leto_runtime.wire.kernel_cache.source_dir()` (which asks `source_dir()` below in an
installed Leto) and JIT-builds each kernel on first use into the kernel cache (docs/KERNELS.md).
The folder keeps its place at the top of the repository (the tree mirrors the process tree:
launcher, runtime, kernels); pyproject.toml maps the package name `leto_cuda` onto it, so that
no package named `cuda` is installed (that would shadow NVIDIA's cuda-python).

Calling contract: `source_dir()` -> the directory of these sources (a real directory: compilers
need files).  Nothing else is importable from here.
"""
from pathlib import Path

# Imported under the name `cuda` -- a checkout's root on sys.path (`python -c` or `python -m` run
# there, PYTHONPATH=<checkout>) -- this file would hide cuda-python's namespace package
# (`cuda.bindings`); extending __path__ keeps the other `cuda` portions importable.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)


def source_dir() -> Path:
    """The directory holding the kernel sources (*.cpp, *.cu, *.cuh, *.h, *.inc)."""
    return Path(__file__).resolve().parent
