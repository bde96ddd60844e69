"""Fixtures shared by every test tier; helpers live in tests/leto_testing.py.

Kernels are built once per session, before the first test (`pytest_sessionstart`): the first
JIT build of the C++ (and, on a GPU machine, CUDA) kernels takes a minute or more, and would
otherwise happen inside whichever test -- or whichever trainer process of a test -- first
needs them, counted against that test's timeout (pytest-timeout counts fixture setup too, so
a session fixture would not help).  Tests marked `alone` run with no other test beside them under
xdist (`pytest_runtest_protocol`).  The trainers the tests start find the built libraries in
the same cache directory (`leto_runtime.wire.kernel_cache`: LETO_EXT_DIR, TORCH_EXTENSIONS_DIR or
~/.cache/leto/kernels; docs/KERNELS.md), which `leto_testing.base_env` passes on."""
from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import time
from pathlib import Path

import pytest

from leto_testing import ROOT, base_env, build_kernels, run, shared_dir, torchrun_cmd


def pytest_sessionstart(session):
    build_kernels(session.config, cuda=None, what="tests/conftest.py")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "alone: timing-sensitive (a measured smoke run, a demo with timeouts); under "
        "xdist no other test runs beside it")
    config.addinivalue_line(
        "markers", "gpu_alone: measures the whole GPU (memory, time); under xdist no other test "
        "runs beside it")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist (`-n 3` in CI, `-n 8` for tests/gpu) tests run side by side; one marked
    `alone` or `gpu_alone` must have the machine (the cores, the GPU) to itself.  A
    readers-writer lock over flock(2) in the run's shared temp folder, held over each test's
    whole protocol (its setup and teardown, so module fixtures that start runs are inside too):
    every test holds it shared, an `alone` test exclusively.  The writer first takes a
    turnstile that readers pass on their way in, so tests that arrive after it wait instead of
    starving it.  Without xdist tests run one at a time and nothing is locked."""
    with _cpu_logged(item):
        if not hasattr(item.config, "workerinput"):
            yield
            return
        yield from _locked(item)


def _locked(item):
    import fcntl

    base = item.config._tmp_path_factory.getbasetemp().parent   # shared by the run's workers
    alone = any(item.get_closest_marker(m) is not None for m in ("alone", "gpu_alone"))
    with open(base / "leto-turnstile.lock", "a+") as gate, \
            open(base / "leto-share.lock", "a+") as share:
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


@contextlib.contextmanager
def _cpu_logged(item):
    """With LETO_TEST_CPU_LOG=FILE, one line per test: its CPU seconds (this process's and
    every descendant's that was waited for: the launcher, its workers, their shadows), its
    wall seconds, its node id and this process's own share of the CPU -- what to trim when
    the suite outgrows its time on two cores."""
    path = os.environ.get("LETO_TEST_CPU_LOG")
    if not path:
        yield
        return

    def cpu(who) -> float:
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    s0, c0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    try:
        yield
    finally:
        own, kids = cpu(resource.RUSAGE_SELF) - s0, cpu(resource.RUSAGE_CHILDREN) - c0
        with open(path, "a") as f:
            f.write(f"{own + kids:.2f} {time.monotonic() - t0:.2f} {item.nodeid} {own:.2f}\n")


# Set by libraries for the rest of the process, whichever test first loads them (torch's
# inductor names its cache directory when it first runs; torch's CUDA initialization sets
# CUDA_MODULE_LOADING; its NCCL process groups their defaults): not a test's change.
_LIBRARY_SET = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "TRITON_", "CUDA_MODULE_LOADING", "NCCL_",
                "TORCH_NCCL_")


def _process_state() -> dict:
    mask = os.umask(0o022)
    os.umask(mask)
    return {"nice": os.getpriority(os.PRIO_PROCESS, 0), "affinity": os.sched_getaffinity(0),
            "umask": mask, "cwd": os.getcwd(),
            "environ": {k: v for k, v in os.environ.items() if not k.startswith(_LIBRARY_SET)}}


@pytest.fixture(autouse=True)
def _process_state_kept():
    """A test must leave its (xdist worker) process as it found it: a nice value, CPU set,
    umask, working directory or environment variable changed here passes to every process every
    later test of this worker starts (a main thread once left at nice 19 made them run 5-15x
    slower beside the other workers; the agent's rendezvous setting, run in process, once
    reached a later test's torchrun workers).  Restored, and the test that changed it fails."""
    before = _process_state()
    yield
    after = _process_state()
    if after != before:
        os.setpriority(os.PRIO_PROCESS, 0, before["nice"])
        os.sched_setaffinity(0, before["affinity"])
        os.umask(before["umask"])
        os.chdir(before["cwd"])
        for k in [k for k in os.environ if k not in before["environ"] and not k.startswith(_LIBRARY_SET)]:
            del os.environ[k]
        os.environ.update(before["environ"])
        changed = {k: (before[k], after[k]) for k in before if before[k] != after[k] and k != "environ"}
        env = before["environ"], after["environ"]
        changed.update({f"${k}": (env[0].get(k), env[1].get(k)) for k in {*env[0], *env[1]}
                        if env[0].get(k) != env[1].get(k)})
        pytest.fail(f"the test changed its process's state (before, after): {changed}")


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory):
    """`get(world, steps, **env)`: the directory of a fault-free run of examples/gpt_inplace.py
    under torchrun (plain mode, no fault tolerance: the oracle of the exactness tests), with
    --out losses and final digests; run once per test run (all xdist workers) for each
    (world, steps, env)."""
    def get(world: int, steps: int, **env: str) -> Path:
        def build(d: Path) -> None:
            p = run(torchrun_cmd("--standalone", "--nproc-per-node", str(world),
                                 str(ROOT / "examples" / "gpt_inplace.py"), "--steps", str(steps),
                                 "--out", str(d)), base_env(**env), timeout=300)
            assert p.returncode == 0, p.stderr[-3000:]
        tag = hashlib.sha256(repr(sorted(env.items())).encode()).hexdigest()[:12]
        return shared_dir(tmp_path_factory, f"gpt_ref_w{world}_s{steps}_{tag}", build)
    return get


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d
