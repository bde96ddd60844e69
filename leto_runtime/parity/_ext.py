"""Builds and loads the parity kernels through the kernel cache: the CUDA codec (and, for
rmu/fused.py, the RMU extension) as PyTorch extensions, the C++ CPU codec as a plain library
(`parity.cpu_kernels`).

Role: the torch-extension builder.  The sources ship with the package (`leto_cuda`, the
repository's cuda/) and are JIT-built on first use with `torch.utils.cpp_extension.load`, not at
install time: torch is the user's choice and unpinned, and an install-time build would need that
torch and a matching CUDA toolkit inside pip's isolated build environment.  Where a build is
kept, when it is reused and how it is announced is `leto_runtime.wire.kernel_cache`'s job (keyed by
the sources' digest; docs/KERNELS.md); a cached build imports in milliseconds.  No network
access is involved.

Calling contract: `load_cpu()` returns `cpu_kernels.CpuKernels`, `load_cuda()` the extension
module; both raise
`ParityBackendUnavailable` with an actionable message; they never fall back silently (that is
the backend selector's job).  Results are cached per process, failures too.  `_load(name,
sources, cuda)` is the shared builder (sources: names in the source folder, or paths in it).

Environment: LETO_EXT_DIR (the cache root), LETO_EXT_VERBOSE=1 (compiler output),
TORCH_CUDA_ARCH_LIST (CUDA targets; default: the GPUs present), CXX (the C++ compiler).
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from types import ModuleType

from leto_runtime.wire import settings
from leto_runtime.wire import kernel_cache as K

from .errors import ParityBackendUnavailable

_lock = threading.Lock()
_cache: dict[str, ModuleType | ParityBackendUnavailable] = {}
CFLAGS = ["-O3", "-Wno-psabi"]
CUDA_CFLAGS = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
CUDA_LDFLAGS = ["-ldl"]          # rmp_probe.cpp: dlopen(libcuda.so.1) (glibc < 2.34)


def source_dir() -> Path:
    """The kernel sources (`kernel_cache.source_dir()`)."""
    return K.source_dir()


def _compiler() -> str | None:
    return K.cxx()


def _relative(sources: list[str]) -> tuple[str, ...]:
    src = K.source_dir().resolve()
    return tuple(Path(s).resolve().relative_to(src).as_posix() if Path(s).is_absolute() else s
                 for s in sources)


@contextlib.contextmanager
def _cxx_env(cxx: str):
    """torch compiles with $CXX or `c++`: name the compiler we found (and hashed) when CXX is unset."""
    if settings.get().cxx:
        yield
        return
    os.environ["CXX"] = cxx
    try:
        yield
    finally:
        os.environ.pop("CXX", None)


def _nvcc() -> str:
    import torch.utils.cpp_extension as cpp
    return settings.get().pytorch_nvcc or os.path.join(cpp.CUDA_HOME or "", "bin", "nvcc")


def _load(name: str, sources: list[str], cuda: bool, what: str | None = None) -> ModuleType:
    import torch.utils.cpp_extension as cpp

    kind = "cuda" if cuda else "cpu"
    cxx = _compiler()
    if cxx is None:
        raise ParityBackendUnavailable(kind, K.NO_COMPILER_WHY, K.INSTALL_COMPILER + "; or use backend='reference'")
    try:
        cpp.verify_ninja_availability()
    except RuntimeError:
        raise ParityBackendUnavailable(
            kind, "ninja is not installed",
            "pip install ninja (a dependency of leto; reinstall with `pip install -e .`)") from None
    rel = _relative(sources)
    flags = ("cflags", *CFLAGS) + (("cuda_cflags", *CUDA_CFLAGS, "ldflags", *CUDA_LDFLAGS) if cuda else ())
    what = what or f"the {'C++ and CUDA' if cuda else 'C++'} parity kernels"
    spec = K.Spec(name, what, rel,
                  (cxx, _nvcc()) if cuda else (cxx,), flags, facts=K.torch_facts(cuda),
                  expect=f"about {'2 min' if cuda else '1 min'}, once per machine and source version")
    built: dict[str, ModuleType] = {}

    def build(slot: K.Slot) -> Path:
        kwargs = dict(name=name, sources=[str(slot.src / r) for r in rel], extra_cflags=CFLAGS,
                      build_directory=str(slot.dir), extra_include_paths=[str(slot.src)],
                      verbose=K.verbose())
        if cuda:
            kwargs.update(extra_cuda_cflags=CUDA_CFLAGS, extra_ldflags=CUDA_LDFLAGS)
        with _cxx_env(cxx):
            built["mod"] = cpp.load(**kwargs)
        return Path(built["mod"].__file__)

    try:
        got = K.obtain(spec, build)
        return built.get("mod") or K.import_extension(got.path)
    except ParityBackendUnavailable:
        raise
    except Exception as e:  # compiler errors come as RuntimeError / CalledProcessError
        raise ParityBackendUnavailable(
            kind, f"building {name} failed: {str(e).strip()[-2000:]}",
            "set LETO_EXT_VERBOSE=1 to see the compiler output; backend='reference' still works") from e


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


def load_cpu():
    """The C++ CPU kernels (cuda/parity_cpu.cpp): a plain library through ctypes
    (`parity.cpu_kernels.CpuKernels`), not a torch extension."""
    def build():
        from . import cpu_kernels
        if _compiler() is None:
            raise ParityBackendUnavailable("cpu", K.NO_COMPILER_WHY, K.INSTALL_COMPILER + "; or use backend='reference'")
        try:
            return cpu_kernels.build_and_load()
        except (OSError, K.BuildError) as e:
            raise ParityBackendUnavailable(
                "cpu", f"building {cpu_kernels.NAME} failed: {str(e).strip()[-2000:]}",
                "set LETO_EXT_VERBOSE=1 to see the compiler output; backend='reference' still works") from e
    return _cached("cpu", build)


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
        srcs = ["parity_cuda.cu", "parity_cuda_variants.cu", "parity_cuda_binding.cpp", "rmp_probe.cpp"]
        return _load("leto_parity_cuda", srcs, cuda=True)

    return _cached("cuda", build)
