"""The kernel sources ship with the package and are found through one function, and the kernel
cache's key covers what shapes a build (leto_runtime/wire/kernel_cache.py, docs/KERNELS.md).

Fast checks, nothing compiled: pyproject's package list against the tree, the package-data
globs against cuda/, the one source lookup, that cuda/__init__.py does not hide cuda-python, and
what changes the digest (real files in a copied source folder; only the folder is swapped in)."""
from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

from leto_runtime.wire import kernel_cache as K

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_names_every_package_of_the_tree():
    """pyproject lists its packages (find cannot rename cuda/ to leto_cuda): a new subpackage
    missing from the list would be missing from every wheel."""
    found = set(setuptools.find_packages(str(ROOT), include=["leto_run*", "leto_runtime*", "leto_sim*"]))
    assert set(PYPROJECT["packages"]) == found | {"leto_cuda"}
    assert PYPROJECT["package-dir"] == {"leto_cuda": "cuda"}
    assert "cuda" not in PYPROJECT["packages"]        # would shadow NVIDIA's cuda-python


def test_the_package_data_globs_cover_every_kernel_source():
    globs = PYPROJECT["package-data"]["leto_cuda"]
    src = ROOT / "cuda"
    files = [p.name for p in src.iterdir() if p.is_file() and p.name not in ("README.md", "__init__.py")]
    assert files
    missed = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missed, f"{missed} would not ship in the wheel: add their suffix to package-data"


def test_one_lookup_finds_the_sources_of_this_checkout():
    import leto_cuda
    assert K.source_dir() == (ROOT / "cuda").resolve()
    assert leto_cuda.source_dir() == K.source_dir()      # the editable install maps leto_cuda
    from leto_runtime.parity import _ext, baked
    assert _ext.source_dir() == K.source_dir() and baked.HEADER.parent == K.source_dir()


def test_cuda_init_does_not_hide_cuda_python():
    """With the checkout's root first on sys.path (`python -c` run there), `cuda` is this
    folder; cuda-python's `cuda.bindings` must still import."""
    pytest.importorskip("cuda.bindings")
    p = subprocess.run([sys.executable, "-c", "from cuda.bindings import driver; import cuda; "
                        "print(cuda.__file__)"], cwd=str(ROOT), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == str(ROOT / "cuda" / "__init__.py")


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A copy of the kernel sources, used as the source folder."""
    d = tmp_path / "cuda"
    shutil.copytree(ROOT / "cuda", d, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(K, "source_dir", lambda: d)
    monkeypatch.setenv("LETO_EXT_DIR", str(tmp_path / "cache"))
    return d


def _spec(**kw) -> K.Spec:
    base = dict(name="leto_parity_cpu", what="t", sources=("parity_cpu.cpp",),
                compilers=tuple(c for c in [K.cxx()] if c), flags=("-O3",),
                facts=K.torch_facts(False))
    return K.Spec(**{**base, **kw})


def test_the_digest_covers_sources_and_their_headers_not_where_they_are(tree, monkeypatch):
    one = K.slot_for(_spec())
    assert one.dir == K.root() / f"leto_parity_cpu-{one.digest[:16]}"
    assert {rel for rel, _ in one.blobs} == {"parity_cpu.cpp", "gf16_bitslice.h", "parity_cpu_kernels.inc"}
    monkeypatch.setattr(K, "source_dir", lambda: ROOT / "cuda")       # the same bytes elsewhere
    assert K.slot_for(_spec()).digest == one.digest
    monkeypatch.setattr(K, "source_dir", lambda: tree)
    with open(tree / "gf16_bitslice.h", "a") as f:                   # a header it includes
        f.write("\n// changed\n")
    assert K.slot_for(_spec()).digest != one.digest


def test_the_digest_covers_compiler_flags_and_facts(tree, monkeypatch):
    d = K.slot_for(_spec()).digest
    assert K.slot_for(_spec(flags=("-O2",))).digest != d
    assert K.slot_for(_spec(facts=(("torch", "0.0"),))).digest != d
    assert K.slot_for(_spec(compilers=(sys.executable,))).digest != d   # identity: path + --version
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    a = K.torch_facts(True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert K.torch_facts(True) != a and K.torch_facts(False) == K.torch_facts(False)


def test_a_missing_source_says_how_to_fix_it(tree):
    (tree / "parity_cpu.cpp").unlink()
    with pytest.raises(FileNotFoundError, match="reinstall leto"):
        K.slot_for(_spec())


def test_an_explicit_cxx_is_the_only_compiler_tried(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert K.cxx() is None
    assert "apt-get install g++" in K.NO_COMPILER and "CXX" in K.NO_COMPILER
