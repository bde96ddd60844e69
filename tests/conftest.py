"""Fixtures shared by every test tier; helpers live in tests/leto_testing.py.

Kernels are built once per session, before the first test (`pytest_sessionstart`): the first
JIT build of the C++ (and, on a GPU machine, CUDA) kernels takes a minute or more, and would
otherwise happen inside whichever test -- or whichever trainer process of a test -- first
needs them, counted against that test's timeout (pytest-timeout counts fixture setup too, so
a session fixture would not help).  The trainers the tests start find the built libraries in
the same cache directory (`leto_runtime.wire.kernel_cache`: LETO_EXT_DIR, TORCH_EXTENSIONS_DIR or
~/.cache/leto/kernels; docs/KERNELS.md), which `leto_testing.base_env` passes on."""
from __future__ import annotations

from pathlib import Path

import pytest

from leto_testing import ROOT, base_env, build_kernels, run, torchrun_cmd


def pytest_sessionstart(session):
    build_kernels(session.config, cuda=None, what="tests/conftest.py")


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory):
    """`get(world, steps, **env)`: the directory of a fault-free run of examples/gpt_inplace.py
    under torchrun (plain mode, no fault tolerance: the oracle of the exactness tests), with
    --out losses and final digests; run once per session for each (world, steps, env)."""
    cache: dict[tuple, Path] = {}

    def get(world: int, steps: int, **env: str) -> Path:
        key = (world, steps, tuple(sorted(env.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"gpt_ref_w{world}_s{steps}")
            p = run(torchrun_cmd("--standalone", "--nproc-per-node", str(world),
                                 str(ROOT / "examples" / "gpt_inplace.py"), "--steps", str(steps),
                                 "--out", str(d)), base_env(**env), timeout=300)
            assert p.returncode == 0, p.stderr[-3000:]
            cache[key] = d
        return cache[key]
    return get


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d
