"""The exit fence against a killed process's GPU work (issue 22: "a promoted trainer never writes
retained memory while the dead process's kernels can still write it").

A victim maps a state manager's page as a trainer maps its retained state, launches a kernel
that keeps bumping counters in it, and is SIGKILLed; this process maps the same page and reads
the counters every few microseconds until they have been still for a second
(`benchmarks/exit_fence.py`, `trial`).  What the promotion waits for -- the fence's EOF, verdict
quiet -- must come after the last change seen, in every trial, with no other retained pages and
with 2,000 of them mapped (the driver's teardown grows with them); the exit notice comes before
it (which is why the notice alone must not wake a promotion on a GPU).  The order of the
fence and the promotion in a real recovery is checked by test_inplace_gpu.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.mark.gpu_alone          # the timings it orders are the whole GPU's
@pytest.mark.parametrize("pages", [0, 2000])
def test_the_exit_fence_comes_after_the_last_write_of_a_killed_process_s_kernel(pages):
    from benchmarks import exit_fence as F
    from leto_run.exit_notice import ExitNotices
    from leto_run.state_manager.pages import CudaPages
    from leto_runtime.wire import protocol as P

    P.raise_nofile_limit()
    cuda_pages = CudaPages(0)
    notices = ExitNotices(enabled=True, gpu=True)
    extra = tuple(cuda_pages.create(F.PAGE) for _ in range(pages))
    for fd in extra:
        os.set_inheritable(fd, True)
    rows = []
    try:
        observe = F.observer()
        for _ in range(4):
            rows.append(F.trial(notices, cuda_pages, observe, 0.0, extra))
    finally:
        notices.close()
        for fd in extra:
            os.close(fd)
    print(f"\npages {pages}: " + "; ".join(
        f"last write {1e3 * r['last_write']:.1f} ms, notice {1e3 * r.get('notice', -1):.2f} ms, "
        f"fence {1e3 * r.get('fence', -1):.1f} ms" for r in rows))
    for r in rows:
        assert r["moving_before_kill"] and r["fence_ok"], r
        assert r["verdict"] == "quiet" and "fence" in r, r
        assert r["fence"] > r["last_write"], f"the fence came before the last write: {r}"
        assert "notice" in r and r["notice"] < r["last_write"], r
