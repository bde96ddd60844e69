"""Builds and loads the C++ (and CUDA) parity kernels from cuda/ as PyTorch extensions, on first use.

Role: the only place that knows about compilers.  `pip install -e .` compiles nothing (its
isolated build environment would pull a multi-GB CUDA torch); instead the first call to
`load_cpu()` / `load_cuda()` JIT-builds the sources with `torch.utils.cpp_extension.load` into a
per-(python, torch, cuda) cache directory and later calls import the cached library in
milliseconds.  No network access is involved.

Calling contract: both functions return the extension module or raise
`ParityBackendUnavailable` with an actionable message; they never fall back silently (that is
the backend selector's job).  Results are cached per process, failures too.

Environment: LETO_EXT_DIR overrides the cache root (default $TORCH_EXTENSIONS_DIR/leto or
~/.cache/leto/torch_extensions); LETO_EXT_VERBOSE=1 shows the compiler output;
TORCH_CUDA_ARCH_LIST picks CUDA targets (default: the GPUs present).
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

from .errors import ParityBackendUnavailable

log = logging.getLogger("leto.parity")

_SRC = Path(__file__).resolve().parents[2] / "cuda"
_lock = threading.Lock()
_cache: dict[str, ModuleType | ParityBackendUnavailable] = {}


def source_dir() -> Path:
    return _SRC


def _build_root() -> Path:
    import torch

    root = os.environ.get("LETO_EXT_DIR")
    if not root:
        base = os.environ.get("TORCH_EXTENSIONS_DIR")
        root = os.path.join(base, "leto") if base else os.path.expanduser("~/.cache/leto/torch_extensions")
    cu = (torch.version.cuda or "cpu").replace(".", "")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_cu{cu}"
    return Path(root) / tag.replace("+", "_")


def _compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx) or shutil.which("g++") or shutil.which("clang++")


def _load(name: str, sources: list[str], cuda: bool) -> ModuleType:
    import torch.utils.cpp_extension as cpp

    if _compiler() is None:
        raise ParityBackendUnavailable(
            "cpu" if not cuda else "cuda", "no C++ compiler found (looked for $CXX, c++, g++, clang++)",
            "install one (Debian/Ubuntu: apt-get install g++; conda: conda install gxx_linux-64) "
            "or use backend='reference'")
    try:
        cpp.verify_ninja_availability()
    except RuntimeError:
        raise ParityBackendUnavailable(
            "cpu" if not cuda else "cuda", "ninja is not installed",
            "pip install ninja (a dependency of leto; reinstall with `pip install -e .`)") from None
    build_dir = _build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    first = not any(build_dir.glob(f"{name}*.so"))
    if first:
        what = "C++ and CUDA" if cuda else "C++"
        print(f"leto.parity: building the {what} parity kernels into {build_dir} "
              f"(first use only, about {'2 min' if cuda else '1 min'}) ...", file=sys.stderr, flush=True)
    cflags = ["-O3", "-Wno-psabi"]
    kwargs = dict(name=name, sources=sources, extra_cflags=cflags, build_directory=str(build_dir),
                  extra_include_paths=[str(_SRC)], verbose=os.environ.get("LETO_EXT_VERBOSE") == "1")
    if cuda:
        kwargs["extra_cuda_cflags"] = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
        kwargs["extra_ldflags"] = ["-ldl"]         # rmp_probe.cpp: dlopen(libcuda.so.1) (glibc < 2.34)
    try:
        with _build_lock(build_dir, name):
            mod = cpp.load(**kwargs)
    except ParityBackendUnavailable:
        raise
    except Exception as e:  # compiler errors come as RuntimeError / CalledProcessError
        raise ParityBackendUnavailable(
            "cuda" if cuda else "cpu", f"building {name} failed: {str(e).strip()[-2000:]}",
            "set LETO_EXT_VERBOSE=1 to see the compiler output; backend='reference' still works") from e
    if first:
        print(f"leto.parity: built {name}.", file=sys.stderr, flush=True)
    return mod


BUILD_LOCK_TIMEOUT = 1200.0      # seconds another process may spend building before we give up


class _build_lock:
    """Serialize builds across processes with flock(2), which the kernel releases when a
    builder dies.  torch's own lock (a `lock` file it waits on forever) survives a builder
    killed mid-build -- e.g. a trainer SIGKILLed by an injected fault during its first build --
    and would hang every later trainer; while we hold the flock no live Leto builder can own
    that file, so a leftover one is stale and removed."""

    def __init__(self, build_dir: Path, name: str):
        self.path, self.name, self.fd = build_dir / ".leto-build.flock", name, -1

    def __enter__(self):
        import fcntl
        import time

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + BUILD_LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise ParityBackendUnavailable(
                        "cpu", f"another process has been building {self.name} for over "
                        f"{BUILD_LOCK_TIMEOUT:.0f} s ({self.path})",
                        "wait for it, or remove the build directory and retry") from None
                time.sleep(0.2)
        stale = self.path.parent / "lock"
        if stale.exists():
            log.warning("leto.parity: removing a stale build lock %s (its builder died)", stale)
            stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)          # releases the flock


def _cached(key: str, fn) -> ModuleType:
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            try:
                hit = fn()
            except ParityBackendUnavailable as e:
                hit = e
            _cache[key] = hit
    if isinstance(hit, ParityBackendUnavailable):
        raise hit
    return hit


def load_cpu() -> ModuleType:
    """The C++ CPU kernels (cuda/parity_cpu.cpp)."""
    return _cached("cpu", lambda: _load("leto_parity_cpu", [str(_SRC / "parity_cpu.cpp")], cuda=False))


def load_cuda() -> ModuleType:
    """The CUDA kernels (cuda/parity_cuda.cu), built only where torch has CUDA and nvcc exists.

    The same extension carries the RMP client's native device-page probe (cuda/rmp_probe.cpp,
    `rmp_probe_unmapped`): it needs the CUDA headers and only ever runs where this builds."""
    def build() -> ModuleType:
        import torch
        import torch.utils.cpp_extension as cpp

        if torch.version.cuda is None:
            raise ParityBackendUnavailable("cuda", f"torch {torch.__version__} is a CPU-only build",
                                           "install a CUDA build of torch")
        if cpp.CUDA_HOME is None:
            raise ParityBackendUnavailable("cuda", "nvcc / CUDA_HOME not found", "install the CUDA toolkit or set CUDA_HOME")
        if not torch.cuda.is_available():
            raise ParityBackendUnavailable("cuda", "no CUDA device is visible")
        srcs = [str(_SRC / f) for f in ("parity_cuda.cu", "parity_cuda_variants.cu", "parity_cuda_binding.cpp",
                                           "rmp_probe.cpp")]
        return _load("leto_parity_cuda", srcs, cuda=True)

    return _cached("cuda", build)
