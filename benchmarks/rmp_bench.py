"""Resilient Memory Pool benchmark: what recovery costs in the memory pool (docs/BENCHMARKS.md,
"Resilient Memory Pool").

Measured, with a real state manager and fd keeper (`SlotHarness`) and this process as the
trainer:

* **state manager GPU memory**: device-wide free memory (this process's context already exists)
  before and after the state manager starts and allocates, minus what it allocated for the pool;
  and whether nvidia-smi lists the state manager as a compute process at all.  Goal 0 MiB.
* **attach/map** of a retained state of `--retained-gib` GiB (default 64, unprotected): from the
  attach request to a mapped, zero-copy tensor (fds streamed in batches of 253, imported, mapped
  back to back, closed).  Goal <= 100 ms for 64 GiB.
* **localization per 1,000 pages**: the client's device probe (cuPointerGetAttribute on every page
  of the attached state) per 1,000 pages, and the whole `localize()` call (probe + state-manager
  host scan + marks).  Goal <= 1 ms per 1,000 pages (paper: 36 ms per recovery).
* **reconstruction** of 16 lost pages (a DRAM row, retired and remapped) in one protection group
  of `--data-pages` pages (default 1024 x 2 MiB = 2 GiB): `reconstruct()` end to end (parity
  staged to the GPU, decode in place, parity rows back, marks cleared); checked bit-exact against
  a copy.  Goal <= 5 ms (paper: 140 ms).

    python benchmarks/rmp_bench.py [--device auto|cpu|cuda:N] [--retained-gib G] [--data-pages D]
                                   [--page-bytes S] [--repeats N] [--json FILE]

stdout: a Markdown table and one PASS/MISS line per goal; progress on stderr.  Exit 0 when every
measurement ran, 1 otherwise.  The state manager is torn down in a `finally`.  The table and the
goal lines are rmp_report.py's, from the result dict that --json writes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

import torch

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.rmp import mapping
from leto_runtime.rmp import reconstruct as R
from leto_runtime.rmp.client import RmpClient
from leto_runtime.rmp.reconstruct import protect, reconstruct
from leto_runtime.wire import settings

# Run as a script only benchmarks/ is on sys.path (the root may be, through PYTHONPATH).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.rmp_report import report_md  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


class _Skip(Exception):
    pass


@contextlib.contextmanager
def knobs(**env):
    """Tuning knobs set for a block (the runtime reads them at each use); None unsets one."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def log(msg: str) -> None:
    print(f"[rmp_bench] {msg}", file=sys.stderr, flush=True)


def raise_nofile() -> tuple[int, int]:
    """Every page is one fd (state manager, keeper): 64 GiB of 2 MiB pages is 32,768."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))     # root: raise the hard limit
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def compute_apps() -> dict[int, int] | None:
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    apps = {}
    for line in r.stdout.strip().splitlines():
        try:
            pid, mib = (x.strip() for x in line.split(","))
            apps[int(pid)] = int(mib)
        except ValueError:
            pass
    return apps


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--retained-gib", type=float, default=64.0)
    ap.add_argument("--data-pages", type=int, default=1024)
    ap.add_argument("--page-bytes", type=int, default=2 * MiB)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="auto", help="parity backend for reconstruction")
    ap.add_argument("--skip-retained", action="store_true", help="only the reconstruction part")
    ap.add_argument("--skip-reconstruct", action="store_true", help="only the retained-state part")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the same-run reconstruction with the staged (old) path")
    ap.add_argument("--probe", choices=("auto", "python"), default="auto",
                    help="python: the cuda-python probe loop (no parity extension needed)")
    ap.add_argument("--map-variants", default="python:1:batch,native:1:batch,native:4:once,"
                    "native:8:once",
                    help="cold-attach variants measured next to the default path: "
                         "PATH:THREADS:GRANT (grant = once | batch), comma-separated")
    ap.add_argument("--json")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.probe == "python":                       # the cuda-python loop for the whole run
        with mapping.override_native_probe(False):
            return run(a)
    return run(a)


def run(a) -> int:
    cuda = torch.cuda.is_available() and a.device != "cpu"
    device = ("cuda:0" if a.device == "auto" else a.device) if cuda else "cpu"
    nofile = raise_nofile()
    res: dict = {"machine": {"host": platform.node(), "python": platform.python_version(),
                             "torch": torch.__version__, "device": device,
                             "gpu": torch.cuda.get_device_name(0) if cuda else None,
                             "kernel": platform.release(), "nofile": nofile,
                             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
                 "args": vars(a)}
    if cuda:
        torch.zeros(1, device=device)                 # our context first: the delta is the SM's
        torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info(0)[0] if cuda else None
    geom = Geometry(a.data_pages, 16, 1, a.page_bytes)
    ok = True
    slot = SlotHarness(device=device, geometry=geom, ready_timeout=120)
    try:
        free_started = torch.cuda.mem_get_info(0)[0] if cuda else None
        c = RmpClient(slot.socket)
        page = c.info["device_page_bytes"]
        res["page_bytes"] = page
        if a.skip_retained:
            raise _Skip()
        nbytes = bench_allocate(slot, c, a, res, cuda, page, free0, free_started)
        bench_attach(slot, a, res, cuda, page, nbytes)
        if cuda and a.map_variants:
            res["attach_variants"] = bench_variants(slot, a.map_variants, a.repeats)
        res.update(bench_preattached(slot, a.repeats, page))
        c = RmpClient(slot.socket)
        c.release("bench.retained")
        c.close()
    except _Skip:
        pass
    except Exception as e:
        ok = _failed(res, e)
    try:
        if a.skip_reconstruct or not ok:
            raise _Skip()
        bench_reconstruct(slot, a, res, cuda, device)
    except _Skip:
        pass
    except Exception as e:
        ok = _failed(res, e)
    finally:
        slot.close()
    report_md(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0 if ok else 1


def _failed(res: dict, e: Exception) -> bool:
    """A part that raised: the error into `res` and stderr; returns the new `ok` (False)."""
    res["error"] = f"{type(e).__name__}: {e}"
    log(f"FAILED: {res['error']}")
    import traceback
    traceback.print_exc()
    return False


def bench_allocate(slot, c, a, res: dict, cuda: bool, page: int, free0, free_started) -> int:
    """Allocate bench.retained (--retained-gib, whole pages) through client `c` (closed after)
    and, on CUDA, what the state manager costs in GPU memory beyond it.  Returns its bytes."""
    nbytes = int(a.retained_gib * GiB) // page * page
    t0 = time.perf_counter()
    c.allocate("bench.retained", nbytes, kind="process")
    alloc_s = time.perf_counter() - t0
    c.close()
    log(f"allocated {nbytes / GiB:.1f} GiB in {nbytes // page} pages in {alloc_s:.2f} s")
    if cuda:
        free1 = torch.cuda.mem_get_info(0)[0]
        apps = compute_apps()
        res["sm_gpu_memory"] = {
            "start_mib": (free0 - free_started) / MiB,
            "device_free_drop_mib": (free0 - free1) / MiB, "pool_mib": nbytes / MiB,
            "sm_overhead_mib": (free0 - free1 - nbytes) / MiB,
            "sm_listed_by_nvidia_smi": None if apps is None else slot.proc.pid in apps,
            "sm_mib_by_nvidia_smi": None if apps is None else apps.get(slot.proc.pid, 0)}
        log(f"state manager GPU memory: {res['sm_gpu_memory']}")
    res["allocate"] = {"seconds": alloc_s, "pages": nbytes // page, "bytes": nbytes}
    return nbytes


def bench_attach(slot, a, res: dict, cuda: bool, page: int, nbytes: int) -> None:
    """Warm-up + --repeats rounds of attach/map, localize and unmap of bench.retained (on CUDA
    also the probe's reference loop and 4 threads, same run); the statistics into `res`."""
    att, unm, loc_probe, loc_total, probe_py, probe_t4 = [], [], [], [], [], []
    if cuda:
        res["probe_native"] = mapping.native_probe() is not None
    for r in range(a.repeats + 1):
        c = RmpClient(slot.socket)
        t0 = time.perf_counter()
        st = c.attach("bench.retained")
        t = st.tensor(dtype="uint8")
        t1 = time.perf_counter()
        if r == 0:
            t[:page].fill_(1)                    # touch: the mapping works
            assert int(t[page - 1]) == 1
        rep = c.localize()
        assert rep.failed() == 0
        if cuda:                                  # same run: the reference loop and threads
            m = st.mapping
            tp = time.perf_counter()
            assert m.probe_python() == []
            tq = time.perf_counter()
            fn = mapping.native_probe()
            if fn is not None:
                assert list(fn(m.base, m.page_bytes, m.n_pages, None, 4)) == []
            tr = time.perf_counter()
            if r:
                probe_py.append((tq - tp) / m.n_pages * 1000)
                if fn is not None:
                    probe_t4.append((tr - tq) / m.n_pages * 1000)
        del t
        t2 = time.perf_counter()
        c.close()
        t3 = time.perf_counter()
        if r:                                     # repeat 0 is the warm-up
            att.append(t1 - t0)
            unm.append(t3 - t2)
            loc_probe.append(rep.device_probe_s / rep.device_pages_probed * 1000)
            loc_total.append(rep.total_s)
    res["attach_map_s"] = stats(att)
    res["unmap_s"] = stats(unm)
    res["localize_per_1000_pages_s"] = stats(loc_probe)
    res["localize_call_s"] = stats(loc_total)
    if probe_py:
        res["probe_python_per_1000_pages_s"] = stats(probe_py)
    if probe_t4:
        res["probe_native_4threads_per_1000_pages_s"] = stats(probe_t4)
    res["localize_pages"] = nbytes // page
    k = settings.get()
    res["attach_path"] = {"path": k.rmp_map, "threads": k.rmp_map_threads,
                          "grant_once": k.rmp_grant_once, "batch": k.rmp_map_batch,
                          "native": mapping._native_map() is not None}
    log(f"attach {res['attach_map_s']}, localize/1000 {res['localize_per_1000_pages_s']}")


def bench_reconstruct(slot, a, res: dict, cuda: bool, device: str) -> None:
    """Reconstruction of 16 pages in one protected group of --data-pages pages: per path
    (CUDA and staged on CUDA, else the default), and per stage on CUDA; into `res`."""
    D = a.data_pages
    page = RmpClient(slot.socket).info["device_page_bytes"]
    from leto_runtime.parity import ParityCode
    used = ParityCode(D, 16, page, backend=a.backend).backend_for(torch.device(device)).name
    res["codec_backend"] = used
    log(f"parity codec backend for {device} pages: {used}")
    if used == "reference" and D * page > 256 * MiB:
        raise RuntimeError(f"the parity codec resolved to the NumPy reference for {device} "
                           "pages (kernels unavailable): a 2 GiB group would take minutes; "
                           "not measured")
    c = RmpClient(slot.socket)
    st = c.allocate("bench.group", D * page)
    gid = st.groups[0].id
    ref = torch.randint(0, 256, (D, page), dtype=torch.uint8, device=st.device)
    st.pages().copy_(ref)
    t0 = time.perf_counter()
    protect(st, backend=a.backend)
    res["protect_group_s"] = time.perf_counter() - t0
    del st
    c.close()
    if cuda:
        pc = RmpClient(slot.socket)
        res["old_path_stages_s"] = profile_staged(pc, "bench.group", device)
        pc.close()
    for path in (["cuda", "staged"] if cuda and not a.no_compare else ["default"]):
        with knobs(LETO_RMP_RECONSTRUCT_PATH="staged" if path == "staged" else None):
            rec, remap_s = run_reconstruct(slot, a, D, gid, ref,
                                           first_shift=0 if path != "staged" else 5)
        key = "" if path in ("cuda", "default") else f"_{path}"
        res[f"reconstruct_16_pages_s{key}"] = stats(rec)
        res[f"remap_16_pages_s{key}"] = stats(remap_s)
        log(f"reconstruct ({path} path) {res[f'reconstruct_16_pages_s{key}']}")
    if cuda:                                      # per stage (synchronized at each mark)
        R.STAGE_TIMES = []
        run_reconstruct(slot, a, D, gid, ref, repeats=1, first_shift=11)
        per: dict = {}
        for name, sec in R.STAGE_TIMES[len(R.STAGE_TIMES) // 2:]:   # the repeat after warm-up
            per[name] = per.get(name, 0.0) + sec
        res["fast_path_stages_s"] = per
        R.STAGE_TIMES = None
    res["group_bytes"] = D * page


def bench_variants(slot, spec: str, repeats: int) -> dict:
    """Cold attach of bench.retained per mapping variant (same run, same pages): the
    cuda-python reference and the native loop with threads / grant once or per batch."""
    out = {}
    for v in [x for x in spec.split(",") if x]:
        path, threads, grant = v.split(":")
        with knobs(LETO_RMP_MAP=path, LETO_RMP_MAP_THREADS=threads,
                   LETO_RMP_GRANT_ONCE="1" if grant == "once" else "0"):
            att, unm = [], []
            for r in range(repeats + 1):
                c = RmpClient(slot.socket)
                t0 = time.perf_counter()
                st = c.attach("bench.retained")
                t = st.tensor(dtype="uint8")
                t1 = time.perf_counter()
                if r == 0:
                    assert int(t[-1]) == int(t[-1])           # readable to the last byte
                    assert int(t[st.page_bytes - 1]) == 1      # written by the first attach
                del t
                t2 = time.perf_counter()
                c.close()
                t3 = time.perf_counter()
                if r:
                    att.append(t1 - t0)
                    unm.append(t3 - t2)
        out[v] = {"attach_s": stats(att), "unmap_s": stats(unm)}
        log(f"cold attach {v}: {out[v]['attach_s']}")
    return out


def bench_preattached(slot, repeats: int, page: int) -> dict:
    """The recovery path of a shadow that pre-attached bench.retained while it waited:
    `refresh()` with nothing changed; `refresh()` after another trainer remapped 16 pages
    (re-imported in place); and 16 pages retired while it waited: refresh (drops them) +
    localize + remap (fresh memory mapped in place), each timed; plus the cold attach."""
    shadow = RmpClient(slot.socket)
    t0 = time.perf_counter()
    st = shadow.attach("bench.retained")
    cold = time.perf_counter() - t0
    view = st.tensor(dtype="uint8")
    other = RmpClient(slot.socket)                     # the trainer that recovers first
    other.attach("bench.retained")
    same, changed, full, full_parts = [], [], [], []
    n = st.n_pages
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        rep = shadow.refresh()
        t1 = time.perf_counter()
        assert rep.same == ["bench.retained"], rep
        first = (r * 1009) % (n - 16)
        other.inject_pages(tier="device", state="bench.retained", first=first, count=16)
        loc = other.localize()
        assert loc.marks["bench.retained"].data == list(range(first, first + 16)), loc.marks
        other.remap()
        t2 = time.perf_counter()
        rep = shadow.refresh()
        t3 = time.perf_counter()
        assert rep.changed == {"bench.retained": 16}, rep
        assert st.mapping.probe(list(range(first, first + 16))) == []
        first = (r * 2003 + 500) % (n - 16)
        inj = RmpClient(slot.socket)
        how = inj.inject_pages(tier="device", state="bench.retained", first=first,
                               count=16)["emulation"]
        inj.close()
        t4 = time.perf_counter()
        rep = shadow.refresh()
        t5 = time.perf_counter()
        loc = shadow.localize()
        t6 = time.perf_counter()
        shadow.remap()
        t7 = time.perf_counter()
        assert rep.dropped == ({"bench.retained": 16} if how == "retired" else {}), rep
        assert loc.marks["bench.retained"].data == list(range(first, first + 16)), loc.marks
        other.refresh()                                # keep the other mapping current
        if r:
            same.append(t1 - t0)
            changed.append(t3 - t2)
            full.append(t7 - t4)
            full_parts.append({"refresh": t5 - t4, "localize": t6 - t5, "remap": t7 - t6})
    del view
    other.close()
    shadow.close()
    med = lambda k: statistics.median(p[k] for p in full_parts)
    out = {"preattach_cold_attach_s": cold, "refresh_nothing_changed_s": stats(same),
           "refresh_16_remapped_s": stats(changed), "shadow_recovery_16_retired_s": stats(full),
           "shadow_recovery_16_retired_parts_median_s": {k: med(k) for k in full_parts[0]}}
    log(f"pre-attached: refresh {out['refresh_nothing_changed_s']}, 16 remapped "
        f"{out['refresh_16_remapped_s']}, 16 retired + localize + remap {out['shadow_recovery_16_retired_s']}")
    return out


def run_reconstruct(slot, a, D, gid, ref, repeats=None, first_shift=0):
    """Warm-up + `repeats` rounds of: retire 16 consecutive pages, attach, localize, remap,
    reconstruct (timed), check bit-exact.  Returns (reconstruct seconds, remap seconds)."""
    rec, remap_s = [], []
    repeats = a.repeats if repeats is None else repeats
    for r in range(repeats + 1):
        first = (r * 37 + first_shift) % max(1, D - 15)
        c = RmpClient(slot.socket)
        c.inject_pages(tier="device", group=gid, first=first, count=16)
        c.close()
        c = RmpClient(slot.socket)
        st = c.attach("bench.group")
        loc = c.localize()
        assert loc.marks["bench.group"].data == list(range(first, first + 16)), loc.marks
        t0 = time.perf_counter()
        c.remap()
        t1 = time.perf_counter()
        report = reconstruct(c, backend=a.backend)
        t2 = time.perf_counter()
        assert report.pages == 16
        assert torch.equal(st.pages(), ref), "reconstruction is not bit-exact"
        del st
        c.close()
        if r:
            rec.append(t2 - t1)
            remap_s.append(t1 - t0)
    return rec, remap_s


def profile_staged(c, name, device) -> dict:
    """Stages of the staged path (what reconstruct did before the CUDA path), each synchronized,
    on the intact group: parity H2D, page views + validation, decode of 16 pages (into scratch),
    one tier-1 row back, and the clear_marks round trip."""
    from leto_runtime.parity import ParityCode
    from leto_runtime.parity.code import _as_pages

    st = c.attach(name)
    dev = torch.device(device)
    k, S = st.groups[0].k, st.page_bytes
    code = ParityCode(k, 16, S)
    out: dict = {}
    for rnd in range(2):                              # round 0 warms up
        sync = lambda: torch.cuda.synchronize(dev)
        sync()
        t0 = time.perf_counter()
        p1 = st.tier1(0).to(dev, non_blocking=True)
        p2 = st.tier2(0).to(dev, non_blocking=True)
        sync()
        t1 = time.perf_counter()
        rows = list(st.group_pages(0).unbind(0))
        lost = list(range(100 + rnd, 116 + rnd))
        pages = [None if j in lost else rows[j] for j in range(k)] + list(p1.unbind(0))
        _as_pages(pages, k + 16, S, "pages", allow_none=True)
        t2 = time.perf_counter()
        code.decode(pages)
        sync()
        t3 = time.perf_counter()
        scratch = torch.empty_like(st.tier1(0)[0])
        scratch.copy_(p1[0])
        sync()
        t4 = time.perf_counter()
        c.clear_marks(name)
        t5 = time.perf_counter()
        del rows, pages, p1, p2
        out = {"stage parity (17 pages, 34 MiB)": t1 - t0, "page views + validation": t2 - t1,
               "decode (API, incl. views' address array)": t3 - t2, "one parity row back": t4 - t3,
               "clear_marks round trip": t5 - t4}
    del st
    return out


if __name__ == "__main__":
    sys.exit(main())
