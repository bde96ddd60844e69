"""The kernel cache: where Leto's native kernels are built, when a build is reused, and what a
build tells the user.

Role: Leto ships its kernel sources as package data (package `leto_cuda`, the repository's
cuda/) and JIT-builds each kernel on first use, as DeepSpeed does with its op sources.  Not at
install time: torch is unpinned and chosen by the user, so an install-time build would need the
matching torch and CUDA toolkit inside pip's isolated build environment, and would tie the
wheel to one torch.  Five builders use this module: the CUDA parity codec and the RMU
extension (torch extensions: parity/_ext.py, rmu/fused.py), and the C++ parity codec
(parity/cpu_kernels.py), the activation-lending allocator (rmu/lend.py) and the native page
mapper (rmp/native_map.py), plain shared libraries built with the system C++ compiler and
loaded through ctypes.

Key: a build lives in <root>/<name>-<digest[:16]>, the digest a sha256 over the bytes of every
source and every header it includes from the source folder, the system headers it includes
directly from the builder's include folders, the compilers (path and `--version` output), the
flags, and the facts the builder names (torch version, Python ABI, CUDA version, CUDA arch
list).  Two checkouts or venvs with the same sources share one build; different sources never
overwrite each other.  The slot keeps a copy of exactly the bytes hashed (src/) and the build
compiles that copy, so what is hashed is what is compiled whatever happens to the source tree
meanwhile; a manifest written last marks the slot complete, and a complete slot is loaded
without running any build tool -- once its library is the one the manifest recorded (size and
sha256, `cache_trust.intact`): a truncated library would be mapped and kill its loader with SIGBUS.

Concurrency: builders of one slot serialize on an flock(2), which the kernel releases when a
builder dies; who waited finds the manifest and loads.  Every build is announced on stderr
(what, where, why) and its end with the seconds taken.

Other users: a kernel is code that runs as us, so nothing is built or loaded where another user
could write.  Every directory from / down to a slot and to its library must be a real
directory (no symlink) owned by us or root, not writable by group or others unless sticky
(/tmp; above a slot only) or its group is our user-private one or root's (`_trust_dir`): else
`UnsafeCache` names the path and the fix.  A manifest or library that is a symlink, another
user's, or writable by others is not loaded, the slot is rebuilt over it (`_complete`); the
build lock follows ckpt_lock's rules (`BuildLock._open`).  What we create is 0755/0644 (less
the umask), and a built library is made not group/world-writable.

Environment: LETO_EXT_DIR (the root; default $TORCH_EXTENSIONS_DIR/leto, else
$XDG_CACHE_HOME/leto/kernels or ~/.cache/leto/kernels), LETO_EXT_VERBOSE=1 (compiler output),
TORCH_CUDA_ARCH_LIST (CUDA targets, part of the key), CXX (the C++ compiler).

Calling contract:
    got = obtain(Spec(name, what, sources, compilers, flags, ...), build)
    # build(slot) compiles slot.src's copy into slot.dir and returns the library's path
    got.path, got.built, got.seconds
`obtain` raises what `build` raises, `BuildLockTimeout` and `UnsafeCache`.  Building everything this machine
can use at once is `leto_runtime.kernel_build` (`leto-run --build-kernels`).  See docs/KERNELS.md.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from leto_runtime.wire import file_trust, settings
from leto_runtime.wire.cache_trust import (  # noqa: F401  (UnsafeCache is part of this API)
    UnsafeCache, _OPEN_FILE, _file_problem, _no_others_write, _private_dirs, _trust_dir, _write_file,
    intact, library_record)

log = logging.getLogger("leto.kernels")

FORMAT = 1                      # bump when the slot layout or the digest's inputs change
MANIFEST = "leto-kernel.json"
LOCK_TIMEOUT = 1200.0           # seconds another process may spend building before we give up
COMPILE_TIMEOUT = 600.0         # one compiler run of a plain shared library
NO_COMPILER_WHY = "no C++ compiler found (looked for $CXX, else c++, g++, clang++ on PATH)"
INSTALL_COMPILER = ("install one (Debian/Ubuntu: apt-get install g++; RHEL/Fedora: dnf install "
                    "gcc-c++; conda: conda install gxx_linux-64) or point CXX at it")
NO_COMPILER = f"{NO_COMPILER_WHY}: {INSTALL_COMPILER}"
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.M)


class BuildLockTimeout(RuntimeError):
    """Another process held a slot's build lock for longer than LOCK_TIMEOUT."""


class BuildError(RuntimeError):
    """A compiler run of a plain shared library failed (the message has the command and output)."""


def source_dir() -> Path:
    """The kernel sources: the one lookup every builder uses.  In a source checkout (an editable
    install, or the checkout on sys.path) they are the `cuda/` next to this package, so the
    sources always match the Python code that runs; in an installed wheel, package `leto_cuda`."""
    here = Path(__file__).resolve().parents[2] / "cuda"
    if (here / "parity_cpu.cpp").is_file():
        return here
    try:
        import leto_cuda
    except ImportError:
        raise FileNotFoundError(
            f"Leto's kernel sources are missing (neither {here} nor the package leto_cuda exists): "
            "reinstall leto (`pip install -e .` in a checkout)") from None
    return leto_cuda.source_dir()


def root() -> Path:
    """The cache root (see the module docstring for the environment that moves it)."""
    r = settings.get().ext_dir
    if r:
        p = Path(r).expanduser()
    elif settings.get().torch_extensions_dir:
        p = Path(settings.get().torch_extensions_dir).expanduser() / "leto"
    else:
        p = Path(settings.get().xdg_cache_home or os.path.expanduser("~/.cache")) / "leto" / "kernels"
    # Resolved once: a library is loaded by this path, never through a symlink someone could
    # repoint after the checks (`_private_dirs` lstats every component).
    return Path(os.path.realpath(os.path.abspath(p)))


def verbose() -> bool:
    return settings.get().ext_verbose


def cxx() -> str | None:
    """The C++ compiler's path: $CXX if set (an explicit choice: nothing else is tried), else the
    first of c++, g++, clang++ on PATH; None when there is none."""
    env = settings.get().cxx
    if env:
        return shutil.which(env)
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


@functools.lru_cache(maxsize=None)
def compiler_identity(path: str) -> str:
    """`path`, where it resolves to, and its `--version` output (part of every digest)."""
    try:
        p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        out = (p.stdout or p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out = f"--version failed: {e}"
    return f"{path} -> {os.path.realpath(path)}\n{out}"


def cuda_arch_list() -> str:
    """The CUDA targets a torch extension is built for: TORCH_CUDA_ARCH_LIST, else (torch's own
    default) the compute capabilities of the visible GPUs."""
    env = settings.get().torch_cuda_arch_list.strip()
    if env:
        return env
    import torch
    if not torch.cuda.is_available():
        return "none visible"
    caps = {"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(sorted(caps))


def torch_facts(cuda: bool) -> tuple[tuple[str, str], ...]:
    """What shapes a torch extension besides its sources and flags: torch (version, commit,
    C++ ABI, CUDA version), the Python ABI and, for CUDA code, the arch list."""
    import torch
    facts = {"torch": torch.__version__, "torch_git": str(torch.version.git_version),
             "torch_cuda": str(torch.version.cuda), "python": sys.implementation.cache_tag,
             "ext_suffix": str(sysconfig.get_config_var("EXT_SUFFIX")),
             "cxx11_abi": str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "?"))}
    if cuda:
        facts["cuda_arch_list"] = cuda_arch_list()
    return tuple(sorted(facts.items()))


@dataclass(frozen=True)
class Spec:
    """What one kernel is built from.  `flags` holds every flag that shapes the output, and no
    path into the cache (the build adds its slot's include folder itself)."""
    name: str                                   # library / extension module name
    what: str                                   # for people: "the C++ parity kernels"
    sources: tuple[str, ...]                    # compiled files, relative to source_dir()
    compilers: tuple[str, ...] = ()             # the compilers the build runs (paths)
    flags: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ()          # system include folders (e.g. the CUDA headers)
    facts: tuple[tuple[str, str], ...] = ()     # e.g. torch_facts()
    expect: str = "a few seconds"               # how long a build takes, for the start line


@dataclass(frozen=True)
class Slot:
    """One cache entry: `dir` = <root>/<name>-<digest[:16]>, `src` = the hashed sources' copy."""
    spec: Spec
    digest: str
    dir: Path
    inputs: str                                  # the digest's inputs (JSON), kept in the manifest
    blobs: tuple[tuple[str, bytes], ...]         # (relative name, bytes) of every hashed file

    @property
    def src(self) -> Path:
        return self.dir / "src"


@dataclass(frozen=True)
class Obtained:
    name: str
    path: Path                                   # the library
    built: bool                                  # False: a cache hit
    seconds: float                               # the build's (0 for a hit)


_outcomes: dict[str, Obtained] = {}             # name -> this process's first obtain() of it


def outcome(name: str) -> Obtained | None:
    """How this process got kernel `name` (None: not yet)."""
    return _outcomes.get(name)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _closure(src: Path, sources: tuple[str, ...], include_dirs: tuple[str, ...]):
    """(relative name, bytes) of the sources and of every header they include from `src`,
    recursively, and (path, bytes) of the headers included directly from `include_dirs`."""
    local: dict[str, bytes] = {}
    external: dict[str, bytes] = {}
    todo = list(sources)
    while todo:
        rel = todo.pop(0)
        if rel in local:
            continue
        path = src / rel
        try:
            data = path.read_bytes()
        except OSError as e:
            raise FileNotFoundError(f"kernel source {path} is unreadable ({e}): reinstall leto") from None
        local[rel] = data
        for kind, inc in _INCLUDE.findall(data.decode("utf-8", "replace")):
            near = (path.parent / inc).resolve()
            if kind == '"' and near.is_file() and near.is_relative_to(src):
                todo.append(near.relative_to(src).as_posix())
                continue
            hit = next((Path(d) / inc for d in include_dirs if (Path(d) / inc).is_file()), None)
            if hit is not None and str(hit) not in external:
                external[str(hit)] = hit.read_bytes()
    return local, external


def slot_for(spec: Spec) -> Slot:
    """Hash what `spec` builds from (reads the sources once) and name its slot."""
    src = source_dir().resolve()
    local, external = _closure(src, spec.sources, spec.include_dirs)
    inputs = json.dumps({
        "format": FORMAT, "name": spec.name,
        "files": sorted([rel, _sha(b)] for rel, b in local.items()),
        "system_headers": sorted([p, _sha(b)] for p, b in external.items()),
        "compilers": [compiler_identity(c) for c in spec.compilers],
        "flags": list(spec.flags), "facts": dict(spec.facts),
    }, sort_keys=True, indent=1)
    digest = _sha(inputs.encode())
    return Slot(spec, digest, root() / f"{spec.name}-{digest[:16]}", inputs, tuple(local.items()))


def _read_manifest(slot: Slot) -> dict | None:
    """The slot's manifest if it is a file we may trust (see the module doc), else None."""
    try:
        fd = os.open(slot.dir / MANIFEST, os.O_RDONLY | _OPEN_FILE)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if _file_problem(os.fstat(f.fileno())) is not None:
            return None               # not ours to believe: rebuilt (replaced) under the lock
        try:
            man = json.loads(f.read())
        except ValueError:
            return None
    return man if isinstance(man, dict) else None


def _complete(slot: Slot) -> Path | None:
    """The library of a complete slot (manifest present, same digest, library there), else None.
    Never a library we must not load: a name leaving the slot, a symlink, another user's file
    or one others may write, or one below a directory others may write (`UnsafeCache`)."""
    man = _read_manifest(slot)
    if man is None or man.get("digest") != slot.digest:
        return None
    rel = Path(str(man.get("library", "")))
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        return None
    cur = slot.dir
    for part in rel.parts[:-1]:
        cur = cur / part
        if not cur.is_dir():
            return None
        _trust_dir(cur)
    lib = slot.dir / rel
    try:
        st = os.lstat(lib)
    except OSError:
        return None
    return lib if _file_problem(st) is None and intact(lib, st, man) else None


def _discard_damaged(slot: Slot) -> None:
    """Under the slot's lock, before a rebuild: the manifest and the library it names go, so
    that the build really links a new one (a torch extension's ninja would find the damaged
    library newer than its inputs and keep it).  Unlinked, not truncated: a process that mapped
    the old file keeps its pages."""
    man = _read_manifest(slot)
    if man is None:
        return
    rel = Path(str(man.get("library", "")))
    targets = [slot.dir / MANIFEST]
    if rel.parts and not rel.is_absolute() and ".." not in rel.parts:
        targets.insert(0, slot.dir / rel)
    for p in targets:
        try:
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
        except FileNotFoundError:
            pass


def _why(slot: Slot) -> str:
    if not slot.src.exists():
        return "no build for these sources yet"
    if not (slot.dir / MANIFEST).exists():
        return "a previous build of these sources did not finish"
    return ("the cached build is incomplete or damaged (its library is missing, unreadable, or not "
            "the one its manifest recorded: truncated or changed since it was built)")


def say(msg: str) -> None:
    """A progress line on stderr (builds are rare and slow: they are never silent)."""
    print(f"leto: {msg}", file=sys.stderr, flush=True)


class BuildLock:
    """Serialize the builders of one slot with flock(2) on <slot>/.leto-build.flock, waiting up to
    LOCK_TIMEOUT.  torch's own lock (a `lock` file it waits on forever) survives a builder killed
    mid-build -- e.g. a trainer SIGKILLed by an injected fault during its first build -- and would
    hang every later one; while we hold the flock no live Leto builder owns that file, so a
    leftover one is stale and removed."""

    def __init__(self, d: Path, name: str, timeout: float = LOCK_TIMEOUT):
        self.path, self.name, self.timeout, self.fd = d / ".leto-build.flock", name, timeout, -1

    def __enter__(self) -> "BuildLock":
        import fcntl
        self.fd = self._open()
        deadline, waited = time.monotonic() + self.timeout, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    say(f"waiting for another process building {self.name} in {self.path.parent} ...")
                    waited = True
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise BuildLockTimeout(
                        f"another process has been building {self.name} for over {self.timeout:.0f} s "
                        f"({self.path}): wait for it, or remove {self.path.parent} and retry") from None
                time.sleep(0.2)
        stale = self.path.parent / "lock"
        if os.path.lexists(stale) and self._ours(stale):
            log.warning("leto: removing a stale build lock %s (its builder died)", stale)
            stale.unlink(missing_ok=True)
        return self

    def _open(self) -> int:
        """The lock file, created 0600 if absent; refused unless a regular file of ours with one
        link (a planted symlink would have us truncate its target, a FIFO would hang us)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _OPEN_FILE, 0o600)
        except OSError as e:
            raise UnsafeCache(self.path, "is a symbolic link (possibly planted by another user)"
                              if e.errno == errno.ELOOP else
                              f"cannot be opened ({e.strerror or e})") from None
        st = os.fstat(fd)
        why = file_trust.problem(st, "file", one_link=True) or _file_problem(st)
        if why is not None:
            os.close(fd)
            raise UnsafeCache(self.path, why)
        return fd

    @staticmethod
    def _ours(path: Path) -> bool:
        st = os.lstat(path)
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()

    def __exit__(self, *exc) -> None:
        os.close(self.fd)          # releases the flock


def _write_sources(slot: Slot) -> None:
    for rel, data in slot.blobs:
        dst = slot.src / rel
        _private_dirs(dst.parent)
        try:
            st = os.lstat(dst)
            same = _file_problem(st) is None and dst.read_bytes() == data
        except OSError:
            same = False
        if same:
            continue               # unchanged: keeps its mtime, so an unfinished build resumes
        _write_file(dst, data)


def _write_manifest(slot: Slot, lib: Path, seconds: float) -> None:
    size, sha = library_record(lib)            # what `intact` checks before every first load
    man = {"digest": slot.digest, "name": slot.spec.name, "library": lib.relative_to(slot.dir).as_posix(),
           "size": size, "sha256": sha,
           "seconds": round(seconds, 2), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "inputs": json.loads(slot.inputs)}
    _write_file(slot.dir / MANIFEST, json.dumps(man, indent=1).encode())


def obtain(spec: Spec, build: Callable[[Slot], Path]) -> Obtained:
    """The library of `spec`: from its slot if complete, else built there by `build(slot)` (under
    the slot's lock, announced on stderr); see the module docstring."""
    slot = slot_for(spec)
    _private_dirs(slot.dir)                    # raises UnsafeCache: see the module doc
    lib = _complete(slot)
    if lib is None:
        with BuildLock(slot.dir, spec.name):
            lib = _complete(slot)              # another process built it while we waited
            if lib is None:
                why = _why(slot)
                _discard_damaged(slot)
                return _remember(_build(slot, build, why))
    return _remember(Obtained(spec.name, lib, False, 0.0))


def _build(slot: Slot, build: Callable[[Slot], Path], why: str) -> Obtained:
    spec = slot.spec
    say(f"building {spec.name} ({spec.what}) into {slot.dir}: {why}; {spec.expect} ...")
    t0 = time.monotonic()
    try:
        _write_sources(slot)
        lib = Path(build(slot))
    except BaseException:
        say(f"building {spec.name} failed after {time.monotonic() - t0:.1f} s")
        raise
    dt = time.monotonic() - t0
    _no_others_write(lib)                      # else `_complete` would refuse it next time
    _write_manifest(slot, lib, dt)
    say(f"built {spec.name} in {dt:.1f} s ({lib})")
    return Obtained(spec.name, lib, True, dt)


def _remember(got: Obtained) -> Obtained:
    _outcomes.setdefault(got.name, got)
    return got


def import_extension(path: Path):
    """Import the Python extension module at `path` (a torch extension from a complete slot:
    torch is imported first, the library links against it)."""
    import importlib.util

    import torch  # noqa: F401
    # the module name is the file's stem: PyInit_<name> (torch may have versioned it, name_v1)
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the extension {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_library(slot: Slot, compiler: str, before: list[str], after: list[str], out: str) -> Path:
    """One compiler run: `compiler *before <slot's sources> -o <tmp> *after`, then the output
    renamed to <slot>/<out> (a reader never sees a half-written library).  Raises BuildError."""
    tmp = slot.dir / f".{out}.{os.getpid()}.tmp"
    cmd = [compiler, *before, *(str(slot.src / s) for s in slot.spec.sources), "-o", str(tmp), *after]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{' '.join(cmd)} ran over {COMPILE_TIMEOUT:.0f} s") from None
    except OSError as e:
        raise BuildError(f"{' '.join(cmd)}: {e}") from None
    if verbose():
        sys.stderr.write(p.stdout + p.stderr)
    if p.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    _no_others_write(tmp)
    os.replace(tmp, slot.dir / out)
    return slot.dir / out
