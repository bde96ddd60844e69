"""GPU tier: every test here is marked `gpu` and skipped, with the reason, where no CUDA device
is visible (CI, CPU dev machines).  Run on the lent H200: `pytest tests/gpu -q`."""
from __future__ import annotations

import pytest


def _no_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a core dependency
        return f"torch is not importable ({e})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return None


def pytest_sessionstart(session):
    """The CUDA kernels (parity, RMU fused AdamW) are built before the first test, not inside
    it: a fresh H200 spends minutes compiling them, which the first GPU test used to pay
    against its 300 s timeout.  Run when this directory is named on the command line
    (`pytest tests/gpu`); `pytest tests` gets them from tests/conftest.py."""
    if _no_cuda_reason() is None:
        from leto_testing import build_kernels

        build_kernels(session.config, cuda=True, what="tests/gpu/conftest.py")


def pytest_collection_modifyitems(config, items):
    reason = _no_cuda_reason()
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"))


@pytest.fixture(autouse=True)
def _cache_given_back():
    """What a test's process cached on the device goes back after it (torch keeps freed blocks
    reserved): a `gpu_alone` test that fills the device runs beside idle xdist workers, whose
    caches would otherwise hold gigabytes of it."""
    yield
    import torch
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
