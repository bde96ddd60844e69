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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_alone: measures the whole device (memory, time); under xdist no other "
        "GPU test runs beside it")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist (`pytest tests/gpu -n 8`) the workers' tests share the GPU; a test that
    measures the whole device (`cudaMemGetInfo`) must have it alone.  A readers-writer lock over
    flock(2) in the run's shared temp folder, held over each test's whole protocol (its setup
    and teardown, so module fixtures that start runs are inside too): every test holds it
    shared, a `gpu_alone` test exclusively.  The writer first takes a turnstile that readers
    pass on their way in, so tests that arrive after it wait instead of starving it.  Without
    xdist tests run one at a time and nothing is locked."""
    import fcntl

    if not hasattr(item.config, "workerinput"):
        yield
        return
    base = item.config._tmp_path_factory.getbasetemp().parent   # shared by the run's workers
    alone = item.get_closest_marker("gpu_alone") is not None
    with open(base / "leto-gpu-turnstile.lock", "a+") as gate, \
            open(base / "leto-gpu-share.lock", "a+") as share:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(share, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(share, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(share, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
