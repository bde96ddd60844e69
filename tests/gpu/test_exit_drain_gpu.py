"""The drain words against a killed process's GPU work (issue 22, item 1: a promoted trainer
never writes retained memory while the dead process's kernels can still write it; the drain
lets the promotion start before the exit fence when the death came while the update waited for
the GPU: leto_runtime/drain.py).

A victim maps a retained page, opens its drain window, launches a kernel that keeps bumping
counters in the page and is SIGKILLed while the kernel runs (`benchmarks/exit_fence.py`,
`trial`).  This process reads the page through its own mapping.  What the agent's exit-notice
waiter says is checked against what the page does:

* "covered" -- the window closed after the launch, the kernel would end 10-40 ms after the kill
  (its length rotates over the trials: `COVERED_S`).  The driver's teardown stops it earlier
  in some trials (H100, 2026-12-06: in 3 of 5 with a 35 ms tail, ~11 ms after the kill;
  2026-12-07: in 8 of 8, 11-32 ms after it, so a single length can miss the case the test is
  for); then the sentinel queued behind it never runs and no "drained" comes (the fence
  decides, as without the words).  The kernel marks its own end in the page, so the test
  knows which trials ran to the end: each of those gets "drained", and the page never changes
  after it (read right after the verdict, against its final contents); it comes before the
  fence in most of them (that is the point);
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


# "covered" kernels of 30, 45 and 60 ms, killed ~20 ms after the launch: ending 10-40 ms after
# the kill, before and after the teardown would stop them
COVERED_S = (0.03, 0.045, 0.06)


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
        for i in range(9 if drain == "covered" else 5):
            rows.append(F.trial(notices, pages, observe, 0.0, (), drain,
                                COVERED_S[i % 3] if drain == "covered" else None))
    finally:
        notices.close()
    print(f"\ndrain {drain}: " + "; ".join(
        f"last write {1e3 * r['last_write']:.1f} ms, notice {1e3 * r.get('notice', -1):.2f} ms, "
        f"drained {1e3 * r.get('drained', -1):.1f} ms, fence {1e3 * r.get('fence', -1):.1f} ms"
        f"{'' if r['kernel_finished'] else ', kernel stopped by the teardown'}" for r in rows))
    for r in rows:
        assert r["moving_before_kill"] and r["drain_on"], r
        assert r["verdict"] == "quiet" and r["fence"] > r["last_write"], r
        if "drained" in r:
            assert not r["changed_after_drained"], f"the page changed after 'drained': {r}"
    if drain == "covered":
        ended = [r for r in rows if r["kernel_finished"]]
        assert ended, ("the driver's teardown stopped the kernel in every trial, so the "
                       f"'drained' verdict was never exercised: {rows}")
        assert all("drained" in r for r in ended), ended
        assert 2 * sum(r["drained"] < r["fence"] for r in ended) >= len(ended), ended
    if drain == "endless":
        assert not any(r["kernel_finished"] for r in rows), rows
    if drain == "open":
        assert not any("drained" in r for r in rows), rows
