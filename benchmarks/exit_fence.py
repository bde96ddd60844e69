"""When does a killed trainer's GPU work stop writing retained memory? (issue 22, item 1)

The exit notice (leto_run/exit_notice.py) tells the agent of a death within a millisecond, but
the kernel releases the robust mutex early in `do_exit`, long before the driver tears the dead
process's CUDA context down: its kernels may still be writing.  A promoted trainer must not
write retained memory before they stop.  This measures, for a process SIGKILLed while a kernel
of its own keeps writing a retained page, every signal the agent could wait on, against the
moment the writes are last seen:

* **notice**: the robust mutex released (the agent's exit notice);
* **fence**: Leto's exit fence (`LETO_EXIT_FENCE_FD`: moved to the lowest free fd at import,
  checked by `check_fence` once the context exists) reached EOF -- with its verdict;
* **pipe_low** / **pipe_high**: EOF of a pipe whose write end the victim holds at a low fd
  (opened before CUDA) / a high fd (dup'ed after CUDA);
* **nvml_gone**: the victim's pid left NVML's compute-process list;
* **pidfd**: the pidfd readable (what the agent waited for before the notice);
* **last_write**: the last change of any of the kernel's counters seen by an observer that maps
  the same page (the parent, through its own CUDA context, reading every ~20 us).
* **drained** (`--drain covered|endless|open`): the agent's "drained" verdict on the victim's
  drain words (`leto_runtime/drain.py`), which the victim opens around its kernel; with it the
  page as read right after the verdict, which must be the page's final contents.

`--pages N` has the victim map N more retained pages (created and kept by this process, as a
state manager keeps them; imported and mapped by the victim as a trainer maps its retained
state), so the driver's teardown of a trainer with thousands of mappings -- what the fence
waits for in the recovery harness -- is measured against the count.

The page is a state manager's (`leto_run.state_manager.pages.CudaPages`: cuMemCreate, exported
as a POSIX fd), mapped by the victim as a trainer maps it (`leto_runtime.rmp.mapping`). The
writer kernel is built with NVRTC (cuda-python), one thread per SM, each bumping its counter
until the kill.  Calling contract::

    python -m benchmarks.exit_fence [--repeats N] [--mem-gib G] [--pages N] [--json FILE]

Needs one CUDA GPU; exit 2 without one; stdout: a table of medians and extremes per signal, and
for each signal whether it ever came before the last write (a fence must never).
"""
from __future__ import annotations

import argparse
import ctypes
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
from leto_run.exit_notice import ExitNotices  # noqa: E402

PAGE = 2 << 20
SIGNALS = ("notice", "fence", "pipe_low", "pipe_high", "nvml_gone", "pidfd")

KERNEL = r"""
extern "C" __global__ void spin(unsigned long long* p, unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  t = t0;
  unsigned long long i = 0;
  volatile unsigned long long* q = p + blockIdx.x;
  while (t - t0 < ns) {
    q[0] = ++i;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  }
  q[0] = i | (1ull << 63);  // ran to its end (a block the driver's teardown stops never gets here)
}
"""

CHILD = r"""
import os, sys, time, ctypes, json
lo = os.dup(int(sys.argv[1]))                  # a low fd, before CUDA opens its own
os.close(int(sys.argv[1]))
import leto_runtime                            # arms the exit notice
from leto_runtime.rmp.mapping import CudaMapping
from benchmarks.exit_fence import spin_kernel
m = CudaMapping(1, int(sys.argv[3]), 0)
m.map_pages([(0, int(sys.argv[4]))])
extra = [int(x) for x in os.environ.get("EXIT_FENCE_PAGE_FDS", "").split(",") if x]
if extra:                                      # the rest of a trainer's retained state
    mx = CudaMapping(len(extra), int(sys.argv[3]), 0)
    mx.map_pages(list(enumerate(extra)))
launch, sms = spin_kernel()
from leto_runtime import exit_notice
fence_ok = exit_notice.check_fence()
mem = None
gib = float(sys.argv[5])
if gib > 0:
    from cuda.bindings import driver as cu
    mem = cu.cuMemAlloc(int(gib * (1 << 30)))[1]
drain = sys.argv[6]
if drain == "none":
    launch(m.base, sms, int(float(sys.argv[7]) * 1e9))
else:                                          # the update's drain words (leto_runtime/drain.py)
    import torch
    from leto_runtime import drain as D
    d = D.for_device("cuda")
    torch.cuda.current_stream()
hi = 1000
os.dup2(int(sys.argv[2]), hi)                  # a high fd, after every fd CUDA opened
os.close(int(sys.argv[2]))
fds = {}
for f in os.listdir("/proc/self/fd"):
    try:
        fds[f] = os.readlink(f"/proc/self/fd/{f}")
    except OSError:
        pass
print("ready " + json.dumps({"low": lo, "high": hi, "sms": sms, "fence_fd": exit_notice._fence,
      "fence_ok": fence_ok, "drain_on": drain != "none" and d.on,
      "nvidia_fds": sorted(int(k) for k, v in fds.items() if "nvidia" in v)}), flush=True)
if drain != "none":                            # launched once the parent observes the page
    sys.stdin.readline()
    d.begin()
    launch(m.base, sms, int(float(sys.argv[7]) * 1e9))
    if drain in ("covered", "endless"):
        d.close([torch.cuda.current_stream()]) # the kernel ran on the legacy default stream
    print("launched", flush=True)
time.sleep(600)
"""


def spin_kernel():
    """(launch(addr, blocks, ns), SM count) for the current context's device, via NVRTC."""
    from cuda.bindings import driver as cu, nvrtc
    from leto_runtime.wire.host_pages import cu_check
    dev = cu_check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
    A = cu.CUdevice_attribute
    major = cu_check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")
    minor = cu_check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")
    sms = cu_check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "sms")
    err, prog = nvrtc.nvrtcCreateProgram(KERNEL.encode(), b"spin.cu", 0, [], [])
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"nvrtc: {log.decode(errors='replace')}")
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    mod = cu_check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
    fn = cu_check(cu.cuModuleGetFunction(mod, b"spin"), "cuModuleGetFunction")

    def launch(addr: int, blocks: int, ns: int) -> None:
        cu_check(cu.cuLaunchKernel(fn, blocks, 1, 1, 1, 1, 1, 0, 0,
                                   ((addr, ns), (ctypes.c_void_p, ctypes.c_ulonglong)), 0),
                 "cuLaunchKernel")
    return launch, sms


def _wait_readable(fd: int, key: str, out: dict, stop: threading.Event) -> None:
    poller = select.poll()            # poll: with thousands of page fds, fd > FD_SETSIZE
    poller.register(fd, select.POLLIN)
    while not stop.is_set():
        if poller.poll(200):  # a pipe nobody writes to is readable at EOF; a pidfd at the exit
            out[key] = time.monotonic()
            return


def _nvml_gone(pid: int, out: dict, stop: threading.Event) -> None:
    from leto_run.nvml import Nvml, NvmlError
    nv = Nvml.open()
    if nv is None:
        return
    while not stop.is_set():
        try:
            if pid not in nv.process_bytes(0):
                out["nvml_gone"] = time.monotonic()
                return
        except NvmlError:
            pass
        time.sleep(0.0005)


DRAIN_MODES = {"none": 60.0, "covered": 0.06, "endless": 60.0, "open": 0.06}


def trial(notices, pages, observe, mem_gib: float, extra: tuple[int, ...] = (),
          drain: str = "none", kernel_s: float | None = None) -> dict:
    """One victim, killed while its kernel writes.  `drain`: "none" (no drain words), or the
    victim opens its drain window around a kernel of DRAIN_MODES[drain] seconds (`kernel_s`
    instead, where given) and closes it after the launch ("covered": the kernel ends ~35 ms
    after the kill; "endless": it never ends on its own) or not ("open": the words must never
    prove anything).  The kill comes ~20 ms after the launch."""
    from leto_run.exit_notice import fence_verdict
    from leto_runtime.wire import contract as C
    nfd, npage = notices.page()
    fence_r, fence_w = notices.fence()
    lo_r, lo_w = os.pipe()
    hi_r, hi_w = os.pipe()
    page_fd = pages.create(PAGE)
    os.set_inheritable(page_fd, True)
    env = dict(os.environ, **{C.LETO_EXIT_NOTICE_FD: str(nfd), C.LETO_EXIT_FENCE_FD: str(fence_w),
                              "EXIT_FENCE_PAGE_FDS": ",".join(map(str, extra))})
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(lo_w), str(hi_w), str(PAGE),
                          str(page_fd), str(mem_gib), drain,
                          str(DRAIN_MODES[drain] if kernel_s is None else kernel_s)], env=env,
                         pass_fds=(nfd, fence_w, lo_w, hi_w, page_fd) + tuple(extra),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         cwd=str(ROOT))
    for fd in (nfd, fence_w, lo_w, hi_w):
        os.close(fd)
    pidfd = os.pidfd_open(p.pid)
    got: dict = {}
    stop = threading.Event()
    threads = []
    try:
        notices.watch(p.pid, npage)
        line = p.stdout.readline()
        if not line.startswith("ready "):
            raise RuntimeError(f"the victim did not start ({line!r})")
        info = json.loads(line[6:])
        read = observe(page_fd, info["sms"])
        for fd, key in ((fence_r, "fence"), (lo_r, "pipe_low"), (hi_r, "pipe_high"),
                        (pidfd, "pidfd")):
            threads.append(threading.Thread(target=_wait_readable, args=(fd, key, got, stop),
                                            daemon=True))
        threads.append(threading.Thread(target=_nvml_gone, args=(p.pid, got, stop), daemon=True))
        for t in threads:
            t.start()
        if drain != "none":             # the kernel starts now, with the page observed
            p.stdin.write("go\n")
            p.stdin.flush()
            if p.stdout.readline().strip() != "launched":
                raise RuntimeError("the victim did not launch its kernel")
        before = read()
        time.sleep(0.2 if drain == "none" else 0.02)
        moving = read() != before
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        last, last_t = _until_still(notices, p.pid, read, t0, got)
        for t in threads:
            t.join(5)
        verdict = {"v": fence_verdict(fence_r, p.pid) if "fence" in got else None}
        row = {k: round(got[k] - t0, 6) for k in SIGNALS + ("drained",) if k in got}
        if "at_drained" in got:
            row["changed_after_drained"] = got["at_drained"] != last
        row.update(last_write=round(last_t - t0, 6), moving_before_kill=moving, drain=drain,
                   kernel_finished=all(v >> 63 for v in last),
                   drain_on=info.get("drain_on"),
                   nvidia_fds=info["nvidia_fds"], low_fd=info["low"], fence_fd=info["fence_fd"],
                   fence_ok=info["fence_ok"], verdict=verdict.get("v"))
        return row
    finally:
        stop.set()
        if p.poll() is None:
            p.kill()
        p.wait(60)
        notices.forget(p.pid)
        for fd in (fence_r, lo_r, hi_r, pidfd, page_fd):
            os.close(fd)


def _until_still(notices, pid: int, read, t0: float, got: dict) -> tuple:
    """Read the page until it has been still for a second (20 s at most), and the agent's
    notices meanwhile: (last contents, when they last changed)."""
    last, last_t = read(), t0
    while time.monotonic() - last_t < 1.0 and time.monotonic() - t0 < 20:
        cur = read()
        if cur != last:
            last, last_t = cur, time.monotonic()
        for n in notices.drain():
            if n[0] == pid and n[3] == "began":
                got["notice"] = n[2]
            elif n[0] == pid and n[3] == "drained":
                # what the page holds once the agent may promote: nothing may change after
                got["drained"], got["at_drained"] = n[2], read()
    return last, last_t


def observer():
    """read(page_fd, blocks) -> a function returning the page's counters now (own mapping)."""
    from cuda.bindings import driver as cu
    from leto_runtime.rmp.mapping import CudaMapping
    from leto_runtime.wire.host_pages import cu_check

    def make(page_fd: int, blocks: int):
        m = CudaMapping(1, PAGE, 0)
        m.map_pages([(0, os.dup(page_fd))])
        buf = (ctypes.c_ulonglong * blocks)()

        def read() -> tuple:
            cu_check(cu.cuMemcpyDtoH(buf, m.base, 8 * blocks), "cuMemcpyDtoH")
            return tuple(buf)
        return read
    return make


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--mem-gib", type=float, default=0.0,
                    help="device memory the victim holds besides the page")
    ap.add_argument("--pages", type=int, default=0,
                    help="more retained pages (2 MiB) the victim maps, kept by this process")
    ap.add_argument("--drain", choices=tuple(DRAIN_MODES), default="none",
                    help="the victim's drain words around its kernel (trial's docstring)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.pages < 0 or a.repeats < 1:
        ap.error("--pages must be >= 0 and --repeats >= 1")
    try:
        from leto_run.state_manager.pages import CudaPages
        pages = CudaPages(0)
    except Exception as e:
        print(f"exit_fence: needs a CUDA GPU and cuda-python ({e})", file=sys.stderr)
        return 2
    from leto_runtime.wire import protocol as P
    P.raise_nofile_limit()
    notices = ExitNotices(enabled=True, gpu=True)
    observe = observer()
    rows = []
    extra = tuple(pages.create(PAGE) for _ in range(a.pages))
    for fd in extra:
        os.set_inheritable(fd, True)
    try:
        for i in range(a.repeats):
            rows.append(trial(notices, pages, observe, a.mem_gib, extra, a.drain))
            print(f"trial {i}: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        notices.close()
        for fd in extra:
            os.close(fd)
    print(f"## A victim SIGKILLed while its kernel writes a retained page ({a.repeats} trials, "
          f"{a.mem_gib:g} GiB more device memory, {a.pages} more retained pages mapped, drain "
          f"{a.drain})\n")
    print("| kill -> (ms) | median | min | max | came before the last write |")
    print("|---|---:|---:|---:|---:|")
    for k in ("last_write",) + SIGNALS + ("drained",):
        xs = sorted(r[k] for r in rows if k in r)
        if not xs:
            print(f"| {k} | - | - | - | never seen |")
            continue
        early = sum(1 for r in rows if k in r and k != "last_write" and r[k] < r["last_write"])
        print(f"| {k} | {1e3 * xs[len(xs) // 2]:.2f} | {1e3 * xs[0]:.2f} | {1e3 * xs[-1]:.2f} "
              f"| {early if k != 'last_write' else ''} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "trials": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
