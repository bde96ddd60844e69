"""The report of benchmarks/rmp_bench.py: the Markdown table, the PASS/MISS line per goal and
the notes, printed from its result dict (the dict its --json writes).

Calling contract: `report_md(res)` prints to stdout; a part missing from `res` (skipped, or
failed: then res["error"]) leaves its rows out.  Pure formatting: nothing is measured here.
"""
from __future__ import annotations

GiB = 1 << 30


def report_md(res: dict) -> None:
    ms = lambda s: f"{s * 1e3:.3f}"
    rows = []
    if "attach_map_s" in res:
        gib = res["allocate"]["bytes"] / GiB
        rows.append((f"attach/map {gib:g} GiB ({res['allocate']['pages']} pages)", res["attach_map_s"], 0.100))
        rows.append(("unmap (after views dropped)", res["unmap_s"], None))
        rows.append(("localization, device probe per 1,000 pages", res["localize_per_1000_pages_s"], 0.001))
        rows.append((f"localize() call, {res['localize_pages']} pages", res["localize_call_s"], None))
        if "probe_python_per_1000_pages_s" in res:
            rows.append(("probe per 1,000 pages, cuda-python loop (old), same run",
                         res["probe_python_per_1000_pages_s"], None))
        if "probe_native_4threads_per_1000_pages_s" in res:
            rows.append(("probe per 1,000 pages, native, 4 threads", res["probe_native_4threads_per_1000_pages_s"], None))
        for v, d in (res.get("attach_variants") or {}).items():
            rows.append((f"cold attach/map {gib:g} GiB, variant {v} (path:threads:grant)", d["attach_s"], None))
            rows.append((f"unmap, variant {v}", d["unmap_s"], None))
        if "refresh_nothing_changed_s" in res:
            rows.append((f"attach on the recovery path, pre-attached {gib:g} GiB: refresh, nothing changed",
                         res["refresh_nothing_changed_s"], 0.100))
            rows.append((f"attach on the recovery path, pre-attached {gib:g} GiB: refresh, 16 pages remapped elsewhere",
                         res["refresh_16_remapped_s"], 0.100))
            rows.append(("pre-attached shadow, 16 pages retired while waiting: refresh + localize + remap",
                         res["shadow_recovery_16_retired_s"], None))
    if "reconstruct_16_pages_s" in res:
        rows.append((f"reconstruct 16 pages, {res['group_bytes'] / GiB:g} GiB group",
                     res["reconstruct_16_pages_s"], 0.005))
        rows.append(("remap 16 pages (fresh memory)", res["remap_16_pages_s"], None))
    if "reconstruct_16_pages_s_staged" in res:
        rows.append(("reconstruct 16 pages, staged (old) path, same run", res["reconstruct_16_pages_s_staged"], None))
    print("| metric (ms) | median | min | max | n | goal |")
    print("|---|---|---|---|---|---|")
    for name, s, goal in rows:
        print(f"| {name} | {ms(s['median'])} | {ms(s['min'])} | {ms(s['max'])} | {s['n']} | "
              f"{'' if goal is None else '<= ' + ms(goal)} |")
    for name, s, goal in rows:
        if goal is not None:
            print(f"{'PASS' if s['median'] <= goal else 'MISS'} {name}: median {ms(s['median'])} ms "
                  f"(goal <= {ms(goal)} ms)")
    if "sm_gpu_memory" in res:
        g = res["sm_gpu_memory"]
        print(f"{'PASS' if abs(g['sm_overhead_mib']) < 1 and not g['sm_listed_by_nvidia_smi'] else 'MISS'} "
              f"state manager GPU memory: {g['start_mib']:.1f} MiB to start, "
              f"{g['sm_overhead_mib']:.1f} MiB beyond the pool "
              f"(device free memory dropped {g['device_free_drop_mib']:.0f} MiB for a "
              f"{g['pool_mib']:.0f} MiB pool; listed by nvidia-smi: {g['sm_listed_by_nvidia_smi']})")
    if "protect_group_s" in res:
        print(f"(full encode of the group with the parity codec: {res['protect_group_s'] * 1e3:.1f} ms, "
              f"first call includes any kernel build)")
    for key, title in (("old_path_stages_s", "staged (old) path, per stage"),
                       ("fast_path_stages_s", "CUDA path, per stage")):
        if res.get(key):
            print(f"{title} (ms, each synchronized): " +
                  ", ".join(f"{n} {v * 1e3:.3f}" for n, v in res[key].items()))
    if "shadow_recovery_16_retired_parts_median_s" in res:
        print("pre-attached shadow, 16 retired pages, parts (median ms): " + ", ".join(
            f"{k} {v * 1e3:.3f}" for k, v in res["shadow_recovery_16_retired_parts_median_s"].items())
            + f"; its own cold pre-attach took {res['preattach_cold_attach_s'] * 1e3:.0f} ms")
    if "attach_path" in res:
        print(f"default attach path: {res['attach_path']}")
    if "probe_native" in res:
        print(f"device probe: {'native (cuda/rmp_probe.cpp)' if res['probe_native'] else 'cuda-python loop'}")
    if "error" in res:
        print(f"ERROR: {res['error']}")
