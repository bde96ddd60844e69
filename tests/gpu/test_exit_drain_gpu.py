"""The drain words against a killed process's GPU work (issue 22, item 1: a promoted trainer
never writes retained memory while the dead process's kernels can still write it; the drain
lets the promotion start before the exit fence when the death came while the update waited for
the GPU: leto_runtime/drain.py).

A victim maps a retained page, opens its drain window, launches a kernel that keeps bumping
counters in the page and is SIGKILLed while the kernel runs (`benchmarks/exit_fence.py`,
`trial`).  This process reads the page through its own mapping.  What the agent's exit-notice
waiter says is checked against what the page does:

* "covered" -- the window closed after the launch, the kernel ends ~35 ms after the kill: the
  verdict "drained" comes, and the page never changes after it (read right after the verdict,
  against its final contents); it comes before the fence in most trials (that is the point);
* "endless" -- closed, but the kernel would run for a minute: the driver's teardown stops it;
  a "drained" verdict, if any, still sees the final page;
* "open" -- the kernel launched inside the open window (a death while launching): never
  "drained"; the fence decides."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.mark.gpu_alone          # the timings it orders are the whole GPU's
@pytest.mark.parametrize("drain", ["covered", "endless", "open"])
def test_the_drain_verdict_never_comes_while_a_killed_process_s_kernel_can_write(drain):
    from benchmarks import exit_fence as F
    from leto_run.exit_notice import ExitNotices
    from leto_run.state_manager.pages import CudaPages

    pages = CudaPages(0)
    notices = ExitNotices(enabled=True, gpu=True)
    rows = []
    try:
        observe = F.observer()
        for _ in range(5):
            rows.append(F.trial(notices, pages, observe, 0.0, (), drain))
    finally:
        notices.close()
    print(f"\ndrain {drain}: " + "; ".join(
        f"last write {1e3 * r['last_write']:.1f} ms, notice {1e3 * r.get('notice', -1):.2f} ms, "
        f"drained {1e3 * r.get('drained', -1):.1f} ms, fence {1e3 * r.get('fence', -1):.1f} ms"
        for r in rows))
    for r in rows:
        assert r["moving_before_kill"] and r["drain_on"], r
        assert r["verdict"] == "quiet" and r["fence"] > r["last_write"], r
        if "drained" in r:
            assert not r["changed_after_drained"], f"the page changed after 'drained': {r}"
    if drain == "covered":
        assert all("drained" in r for r in rows), rows
        assert sum(r["drained"] < r["fence"] for r in rows) >= 3, rows
    if drain == "open":
        assert not any("drained" in r for r in rows), rows
