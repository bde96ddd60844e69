"""Detection at the start of an exit (issue 22, item 1): the exit notice next to the pidfd, for
the same SIGKILLed process, in one run.

Role: one *trial* starts a trainer-like child through `leto_run.exit_notice.ExitNotices` (it
imports `leto_runtime`, which arms the notice), lets it touch `--mem-gib` GiB of memory (on the
CPU a larger address space takes longer to tear down; with `--cuda` the memory is device memory
in a CUDA context, whose teardown is the driver's), then records ``time.monotonic()`` right
before ``os.kill(pid, SIGKILL)`` and measures, from there:

* **notice**: the agent's waiter saw the robust mutex released (its own monotonic stamp, taken
  when the wait returned, before the /proc verification);
* **verified**: the notice posted to the agent's pipe (every thread exiting, status read);
* **pidfd**: the child's pidfd became readable -- what the agent waited for before the notice.

The pidfd is polled by a thread of this process that does nothing else, so the two are measured
the same way.  Calling contract::

    python -m benchmarks.exit_notice [--repeats N] [--mem-gib G] [--cuda] [--json FILE]

stdout: a Markdown table (median, p10, p90 per measure, and pidfd / notice of the medians);
exit 0 when every trial produced its numbers, 1 otherwise, 2 on usage errors.  No child outlives
it (each is killed and reaped in a ``finally``).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.provenance import machine_info  # noqa: E402
from leto_run.exit_notice import ExitNotices  # noqa: E402
from leto_runtime.wire import contract as C  # noqa: E402

CHILD = r"""
import sys, time
import leto_runtime
from leto_runtime import exit_notice
gib, cuda = float(sys.argv[1]), sys.argv[2] == "1"
n = int(gib * (1 << 30))
if cuda:
    import torch
    keep = torch.ones(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
else:
    keep = bytearray(n)
    for i in range(0, n, 4096):
        keep[i] = 1
print("ready" if exit_notice._page is not None else "unarmed", flush=True)
time.sleep(600)
"""


def _pidfd_time(pidfd: int, out: dict) -> None:
    select.select([pidfd], [], [], 120)
    out["pidfd"] = time.monotonic()


def trial(notices: ExitNotices, mem_gib: float, cuda: bool) -> dict:
    fd, page = notices.page()
    env = dict(os.environ, **{C.LETO_EXIT_NOTICE_FD: str(fd)})
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(mem_gib), "1" if cuda else "0"],
                         env=env, pass_fds=(fd,), stdout=subprocess.PIPE, text=True,
                         cwd=str(ROOT))
    os.close(fd)
    pidfd = os.pidfd_open(p.pid)
    try:
        notices.watch(p.pid, page)
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the child did not arm its notice ({line!r})")
        got: dict = {}
        waiter = threading.Thread(target=_pidfd_time, args=(pidfd, got), daemon=True)
        waiter.start()
        time.sleep(0.2)                     # the pidfd thread sits in select by now
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        seen = []
        end = t0 + 120
        while not seen and time.monotonic() < end:
            r, _, _ = select.select([notices.fd], [], [], 1.0)
            if r:
                seen = [n for n in notices.drain() if n[0] == p.pid]
        verified = time.monotonic()
        waiter.join(120)
        if not seen or "pidfd" not in got:
            raise RuntimeError("no notice or no pidfd event within 120 s")
        return {"notice_s": seen[0][2] - t0, "verified_s": verified - t0,
                "pidfd_s": got["pidfd"] - t0, "status": seen[0][1]}
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(60)
        notices.forget(p.pid)
        os.close(pidfd)


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--mem-gib", type=float, default=2.0)
    ap.add_argument("--cuda", action="store_true", help="the child's memory is device memory")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    if a.repeats < 1 or not 0 <= a.mem_gib <= 1024:
        ap.error("--repeats must be >= 1 and --mem-gib within [0, 1024]")
    notices = ExitNotices(enabled=True)
    rows = []
    try:
        for i in range(a.repeats):
            rows.append(trial(notices, a.mem_gib, a.cuda))
            print(f"trial {i}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in rows[-1].items()
                                            if k.endswith("_s")), file=sys.stderr)
    except Exception as e:
        print(f"trial failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        notices.close()
    print(f"## Exit notice vs pidfd: SIGKILL of a process holding {a.mem_gib:g} GiB "
          f"({'device' if a.cuda else 'host'} memory), {a.repeats} trials\n")
    print("| kill -> | median ms | p10 | p90 |\n|---|---|---|---|")
    summary = {}
    for k in ("notice_s", "verified_s", "pidfd_s"):
        xs = [r[k] for r in rows]
        summary[k] = {"median": _q(xs, 0.5), "p10": _q(xs, 0.1), "p90": _q(xs, 0.9)}
        print(f"| {k[:-2]} | {summary[k]['median'] * 1e3:.2f} | {summary[k]['p10'] * 1e3:.2f} "
              f"| {summary[k]['p90'] * 1e3:.2f} |")
    ratio = summary["pidfd_s"]["median"] / max(summary["verified_s"]["median"], 1e-9)
    print(f"\npidfd / verified notice (medians): {ratio:.1f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "trials": rows, "summary": summary,
                                            "machine": machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
