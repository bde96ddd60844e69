"""A damaged kernel library in the cache is rebuilt, never loaded (a truncated library is mapped
anyway, and its loader dies of SIGBUS -- every trainer and shadow alike).  The check
(`cache_trust.intact`) over copies of a real built library, truncated and changed; and one real
process loading from a private cache whose library was truncated."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from leto_runtime.wire import cache_trust, kernel_cache as K
from leto_testing import ROOT, base_env

PROBE = """
import torch
from leto_runtime.parity import ParityCode
code = ParityCode(4, 2, 4096, backend="cpu")
print("encode", tuple(code.encode(torch.ones(4, 4096, dtype=torch.uint8)).shape))
"""


@pytest.fixture(scope="module")
def built():
    """The session's C++ parity library (tests/conftest.py built it) and its slot."""
    from leto_runtime.parity import cpu_kernels
    return cpu_kernels.build()                   # a cache hit: the session built it first


def _check(lib, man):
    return cache_trust.intact(lib, os.lstat(lib), man)


def test_only_the_library_its_manifest_recorded_passes(built, tmp_path):
    lib = tmp_path / built.name
    shutil.copy(built, lib)
    size, sha = cache_trust.library_record(lib)
    man = {"size": size, "sha256": sha}
    assert _check(lib, man)
    data = lib.read_bytes()
    i = len(data) // 2
    lib.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])     # one byte off
    assert not _check(lib, man)
    lib.write_bytes(data[:len(data) - 4096])                               # truncated
    assert not _check(lib, man)


def test_a_manifest_of_an_earlier_leto_passes_a_whole_elf_file_only(built, tmp_path):
    lib = tmp_path / built.name
    shutil.copy(built, lib)
    assert _check(lib, {})                       # no record: the ELF file's own extents
    data = lib.read_bytes()
    for cut in (1000, len(data) // 2, len(data) - 1):
        lib.write_bytes(data[:cut])
        assert not _check(lib, {}), cut
    lib.write_bytes(b"not an ELF file at all" * 100)
    assert not _check(lib, {})


def test_a_process_rebuilds_a_truncated_library_instead_of_dying(built, tmp_path):
    cache = tmp_path / "kc"
    slot = cache / built.parent.name
    shutil.copytree(built.parent, slot)          # the session's complete slot, then damaged
    lib = slot / built.name
    lib.write_bytes(lib.read_bytes()[:1000])
    p = subprocess.run([sys.executable, "-c", PROBE], env=base_env(LETO_EXT_DIR=str(cache)),
                       cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "encode (2, 4096)" in p.stdout, (p.returncode, p.stderr[-2000:])
    assert "building leto_parity_cpu" in p.stderr and "damaged" in p.stderr, p.stderr[-2000:]
    man = json.loads((slot / K.MANIFEST).read_text())
    assert (man["size"], man["sha256"]) == cache_trust.library_record(lib)


def test_a_rebuild_starts_without_the_damaged_library(monkeypatch, tmp_path, built):
    """A build tool that keeps an output newer than its inputs (ninja, for the torch
    extensions) would keep the damaged library: the rebuild must find it gone, and a process
    that still maps the old file keeps its own (unlinked, not truncated)."""
    monkeypatch.setenv("LETO_EXT_DIR", str(tmp_path / "kc"))        # (settings read it anew)
    spec = K.Spec("leto_damage_probe", "a probe", ("parity_cpu.cpp",))
    seen = []

    def build(slot):
        lib = slot.dir / "libprobe.so"
        seen.append(lib.exists())
        shutil.copy(built, slot.dir / ".probe.tmp")
        os.replace(slot.dir / ".probe.tmp", lib)
        return lib

    first = K.obtain(spec, build)
    assert first.built and seen == [False]
    held = open(first.path, "rb")                # a process that mapped the library
    before = os.fstat(held.fileno()).st_ino
    with open(first.path, "r+b") as f:           # damaged in place, same inode
        f.truncate(1000)
    K._outcomes.pop("leto_damage_probe", None)
    second = K.obtain(spec, build)
    assert second.built and seen == [False, False], seen
    assert os.fstat(held.fileno()).st_ino == before and os.stat(second.path).st_ino != before
    held.close()
