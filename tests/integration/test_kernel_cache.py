"""The kernel cache in real processes (leto_runtime/wire/kernel_cache.py, docs/KERNELS.md): builds keyed
by the sources' digest, shared by source trees with the same sources, never overwritten by a
different tree, one build for concurrent builders, every build announced; and
`leto-run --build-kernels` on this machine.

Each source tree is a copy of the checkout's cuda/ and leto_runtime/ put first on PYTHONPATH, so
its processes run that tree's code and build that tree's sources.  Every test that builds uses a
private LETO_EXT_DIR and, where the kernel does not matter, the native page mapper (a ~1 s
build; the C++ parity codec takes ~15 s)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from leto_testing import ROOT, base_env, leto_cmd, run

LOAD = """
import json, sys
import leto_runtime
from leto_runtime.wire import kernel_cache as K
kind = sys.argv[1]
if kind == "parity_cpu":
    from leto_runtime.parity import _ext
    _ext.load_cpu().set_isa("auto")          # imported and callable
    got = K.outcome("leto_parity_cpu")
else:
    import ctypes
    from leto_runtime.rmp import native_map
    ctypes.CDLL(native_map.build())
    got = K.outcome("rmp_map")
print(json.dumps({"runtime": leto_runtime.__file__, "sources": str(K.source_dir()),
                  "path": str(got.path), "built": got.built}))
"""
BUILD_LINE = "leto: building "


def make_tree(d: Path) -> Path:
    for part in ("cuda", "leto_runtime"):
        shutil.copytree(ROOT / part, d / part, ignore=shutil.ignore_patterns("__pycache__"))
    return d


def start(tree: Path, cache: Path, kind: str = "parity_cpu") -> subprocess.Popen:
    env = base_env(PYTHONPATH=str(tree), LETO_EXT_DIR=str(cache))
    return subprocess.Popen([sys.executable, "-c", LOAD, kind], env=env, cwd=str(cache.parent),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, tree: Path | None = None, timeout: float = 400) -> tuple[dict, str]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    if tree is not None:        # the tree's own code and sources ran
        assert got["runtime"].startswith(str(tree)) and got["sources"] == str(tree / "cuda")
    return got, err


def load(tree: Path, cache: Path, kind: str = "parity_cpu") -> tuple[dict, str]:
    return finish(start(tree, cache, kind), tree)


def snapshot(slot: Path) -> dict[str, int]:
    return {str(p.relative_to(slot)): p.stat().st_mtime_ns for p in slot.rglob("*") if p.is_file()}


def _mapper_buildable() -> str | None:
    from leto_runtime.wire import kernel_cache as K
    from leto_runtime.rmp import native_map
    if native_map._cuda_include() is None:
        return "no cuda.h to build cuda/rmp_map.cpp"
    return None if K.cxx() else "no C++ compiler"


@pytest.mark.skipif(_mapper_buildable() is not None, reason=str(_mapper_buildable()))
def test_two_trees_share_one_build_and_a_changed_source_builds_apart(tmp_path):
    """With the native page mapper (a ~1 s build; the cache is the same for every kernel, and
    the C++ codec's build, ~15 s here, runs once per test session in the session's cache)."""
    a, b, c = make_tree(tmp_path / "a"), make_tree(tmp_path / "b"), make_tree(tmp_path / "c")
    src = "rmp_map.cpp"
    with open(c / "cuda" / src, "a") as f:
        f.write("\n// a changed copy\n")
    cache = tmp_path / "cache"
    # Three trees load at once into the empty cache: a and b (the same sources) share one build
    # -- one builds, the other waits and loads it -- while c, whose source differs, builds into
    # its own slot beside them, announced.
    pa, pb, pc = (start(t, cache, "rmp_map") for t in (a, b, c))
    (ga, ea), (gb, eb), (gc, ec) = finish(pa, a), finish(pb, b), finish(pc, c)
    assert (ea + eb).count(BUILD_LINE) == 1, ea + eb
    assert "no build for these sources yet" in ea + eb and "built rmp_map in" in ea + eb
    assert sorted([ga["built"], gb["built"]]) == [False, True]
    assert ga["path"] == gb["path"]
    slot = Path(ga["path"]).parent
    assert slot.parent == cache and slot.name.startswith("rmp_map-")
    assert gc["built"] and ec.count(BUILD_LINE) == 1 and "no build for these sources yet" in ec
    other = Path(gc["path"]).parent
    assert other != slot and other.parent == cache
    assert (other / "src" / src).read_bytes().endswith(b"// a changed copy\n")
    # the changed tree's build left the first slot alone: it holds the unchanged sources
    assert (slot / "src" / src).read_bytes() == (a / "cuda" / src).read_bytes()
    before = {slot: snapshot(slot), other: snapshot(other)}
    # Later loads, alternating: cache hits, each tree its own slot, nothing rebuilt or rewritten.
    for tree, want in ((c, other), (a, slot), (b, slot)):
        got, err = load(tree, cache, "rmp_map")
        assert not got["built"] and Path(got["path"]).parent == want and BUILD_LINE not in err, err
    assert {slot: snapshot(slot), other: snapshot(other)} == before


@pytest.mark.skipif(_mapper_buildable() is not None, reason=str(_mapper_buildable()))
def test_concurrent_builders_build_once_and_an_unfinished_build_is_redone(tmp_path):
    """Four processes want the native page mapper (a ~1 s build) from an empty cache at once."""
    cache = tmp_path / "cache"
    procs = [start(ROOT, cache, "rmp_map") for _ in range(4)]
    res = [finish(p) for p in procs]
    errs = "".join(e for _, e in res)
    assert errs.count("leto: building rmp_map") == 1, errs
    assert [g["built"] for g, _ in res].count(True) == 1
    assert len({g["path"] for g, _ in res}) == 1
    slot = Path(res[0][0]["path"]).parent
    # A builder killed mid-build leaves no manifest (and maybe torch's baton `lock`): the next
    # one rebuilds, says why, and clears the stale lock.
    (slot / "leto-kernel.json").unlink()
    (slot / "lock").write_text("")
    got, err = finish(start(ROOT, cache, "rmp_map"))
    assert got["built"] and "a previous build of these sources did not finish" in err
    assert not (slot / "lock").exists() and (slot / "leto-kernel.json").is_file()
    manifest = json.loads((slot / "leto-kernel.json").read_text())
    assert manifest["digest"].startswith(slot.name.rsplit("-", 1)[1])
    assert [f for f, _ in manifest["inputs"]["files"]] == ["rmp_map.cpp"]
    assert any(h.endswith("/cuda.h") for h, _ in manifest["inputs"]["system_headers"])


def _lines(stdout: str) -> dict[str, tuple[str, float, str]]:
    """name -> (status, seconds, path or why) of each `leto-run: kernel ...` line."""
    rows = [re.match(r"leto-run: kernel (\S+) +(\S+) +([\d.]+) s  (.*)$", ln)
            for ln in stdout.splitlines() if ln.startswith("leto-run: kernel ")]
    assert all(rows), stdout
    return {m[1]: (m[2], float(m[3]), m[4]) for m in rows}


def test_build_kernels_on_this_machine(tmp_path):
    """`leto-run --build-kernels` with the session's cache: the C++ codec is there (built at
    session start), the CUDA kernels are skipped with the reason on a CPU-only torch, exit 0."""
    import torch
    p = run(leto_cmd("--build-kernels"), base_env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    got = _lines(p.stdout)
    assert list(got) == ["parity_cpu", "parity_cuda", "rmu_cuda", "lend_alloc", "rmp_map"]
    status, _, path = got["parity_cpu"]
    assert status in ("built", "cached") and path.endswith("leto_parity_cpu.so") and Path(path).is_file()
    if torch.version.cuda is None:
        for name in ("parity_cuda", "rmu_cuda", "lend_alloc", "rmp_map"):
            assert got[name][0] == "skipped" and "CPU-only" in got[name][2], got[name]


def test_build_kernels_without_a_compiler_fails_with_the_fix(tmp_path):
    env = base_env(LETO_EXT_DIR=str(tmp_path / "cache"), CXX="/nonexistent/c++")
    p = run(leto_cmd("--build-kernels"), env, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    status, _, why = _lines(p.stdout)["parity_cpu"]
    assert status == "failed" and "no C++ compiler" in why, why
    assert not any((tmp_path / "cache").glob("*/*.so"))


BUILD_ALL = """
import json
from leto_runtime.kernel_build import build_all
print(json.dumps([b.__dict__ for b in build_all(cuda=True)]))
"""


@pytest.mark.skipif(_mapper_buildable() is not None, reason=str(_mapper_buildable()))
def test_build_all_builds_the_missing_kernels_in_children_and_loads_them_itself(tmp_path):
    """`build_all` with an empty slot for the two plain libraries (the C++ codec's slot copied
    from the session's cache): each is built once, by a child, announced once, and reported
    `built` by the parent, which then loads it from the cache; the CUDA extensions fail with
    the reason on a CPU-only torch instead of stopping the others."""
    import torch
    from leto_runtime.wire import kernel_cache as K
    from leto_runtime.parity import _ext
    cache = tmp_path / "cache"
    codec = Path(_ext.load_cpu().__file__).parent
    shutil.copytree(codec, cache / codec.name)
    p = run([sys.executable, "-c", BUILD_ALL], base_env(LETO_EXT_DIR=str(cache)), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(p.stdout.strip().splitlines()[-1])}
    assert rows["parity_cpu"]["status"] == "cached"
    assert Path(rows["parity_cpu"]["path"]).parent == cache / codec.name
    for name, lib in (("lend_alloc", "leto_lend_alloc"), ("rmp_map", "rmp_map")):
        assert rows[name]["status"] == "built" and rows[name]["seconds"] > 0, rows[name]
        assert Path(rows[name]["path"]).parent.parent == cache
        assert p.stderr.count(f"leto: building {lib} ") == 1, p.stderr
        assert (Path(rows[name]["path"]).parent / K.MANIFEST).is_file()
    if torch.version.cuda is None:
        assert {rows[n]["status"] for n in ("parity_cuda", "rmu_cuda")} == {"failed"}
        assert "CPU-only" in rows["parity_cuda"]["why"]
