"""The variants of benchmarks/rmu_overhead.py and the judgement of their results.

Role: the catalogue (the baselines, each RMU variant's environment, the alternatives to the
default `rmu` path) and the report over a list of result dicts (one per variant, as
rmu_overhead.measure returns them): the Markdown table and the PASS/MISS/INFO lines.

Calling contract: `table(results)` -> Markdown; `verdicts(results)` -> lines, empty unless both
`reference` and `rmu` are among the results.  Pure: no torch, no I/O.
"""
from __future__ import annotations

BASELINES = ("reference", "sync_snapshot", "async_snapshot")
# Environment of each RMU variant's child process (the candidates measured against `rmu`).
RMU_ENV = {"rmu": {}, "rmu_nolend": {"LETO_LEND": "0"},
           "rmu_pipelined": {"LETO_RMU_UNDO_PIPELINE": "1"},
           "rmu_inlinewb": {"LETO_RMU_WB_OVERLAP": "0"},
           "rmu_unbounded": {"LETO_RMU_LOOKAHEAD": "0"},   # the host queues every chunk unwaited
           "rmu_twokernel": {"LETO_RMU_FUSED_SYNDROME": "0"},
           "rmu_hostfunc": {"LETO_RMU_STREAM_MARKER": "hostfunc"},
           "rmu_prev": {"LETO_RMU_FUSED_SYNDROME": "0", "LETO_RMU_STREAM_MARKER": "hostfunc"},
           # the one-kernel chunk's layouts unfolded (the folded chunk is always the ws kernel)
           "rmu_f4": {"LETO_RMU_FUSED_LAYOUT": "4x2x3", "LETO_RMU_FOLD": "0"},
           "rmu_f4s": {"LETO_RMU_FUSED_LAYOUT": "4x2x3-statemajor", "LETO_RMU_FOLD": "0"},
           "rmu_f2": {"LETO_RMU_FUSED_LAYOUT": "2x2x3", "LETO_RMU_FOLD": "0"},
           "rmu_f2s": {"LETO_RMU_FUSED_LAYOUT": "2x2x3-statemajor", "LETO_RMU_FOLD": "0"},
           "rmu_ws": {"LETO_RMU_FUSED_LAYOUT": "ws", "LETO_RMU_FOLD": "0"},   # cuda/adamw_ws.cu
           "rmu_fold": {"LETO_RMU_FOLD": "1"},              # the folded chunk (rmu/fold.py)
           "rmu_fold4": {"LETO_RMU_FOLD": "1", "LETO_RMU_FOLD_BATCH": "4"}}   # counting every 4 stages
ALTERNATIVES = ("rmu_pipelined", "rmu_inlinewb", "rmu_unbounded", "rmu_twokernel", "rmu_hostfunc", "rmu_prev",
                "rmu_f4", "rmu_f4s", "rmu_f2", "rmu_f2s", "rmu_ws", "rmu_fold", "rmu_fold4")
ALL = (*BASELINES, *RMU_ENV)


def table(results: list[dict]) -> str:
    ref = next((r for r in results if r["variant"] == "reference"), None)
    rows = ["| variant | compute (ms) | update (ms) | iteration (ms) | vs reference | update vs ref | peak GPU (GiB) |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rel = upd = "--"
        if ref:
            rel = f"{100 * (r['iteration_ms'] / ref['iteration_ms'] - 1):+.2f}%"
            upd = f"{r['update_ms'] / ref['update_ms']:.2f}x"
        pk = "--" if r.get("peak_gpu_gib") is None else f"{r['peak_gpu_gib']:.2f}"
        rows.append(f"| {r['variant']} | {r['compute_ms']:.1f} | {r['update_ms']:.1f} | "
                    f"{r['iteration_ms']:.1f} | {rel} | {upd} | {pk} |")
    return "\n".join(rows)


def verdicts(results: list[dict]) -> list[str]:
    by = {r["variant"]: r for r in results}
    ref, rmu = by.get("reference"), by.get("rmu")
    if not (ref and rmu):
        return []
    out = []
    it = 100 * (rmu["iteration_ms"] / ref["iteration_ms"] - 1)
    phase = ("update" if rmu["update_ms"] - ref["update_ms"] >= rmu["compute_ms"] - ref["compute_ms"]
             else "compute")
    out.append(f"{'PASS' if it <= 0.5 else 'MISS'} RMU adds <= 0.5% to the iteration: {it:+.2f}% "
               f"(compute {rmu['compute_ms'] - ref['compute_ms']:+.1f} ms, update "
               f"{rmu['update_ms'] - ref['update_ms']:+.1f} ms{'' if it <= 0.5 else f'; held back by the {phase} phase'})")
    x = rmu["update_ms"] / ref["update_ms"]
    out.append(f"{'PASS' if x <= 2 else 'MISS'} RMU update <= 2x the reference update: {x:.2f}x "
               f"({rmu['update_ms']:.1f} vs {ref['update_ms']:.1f} ms)")
    out.append(f"INFO rmu (defaults): one-kernel chunk {'on' if rmu.get('fused_syndrome') else 'off'}, marker "
               f"writes {rmu.get('marker_mode')}, {rmu.get('undo_slots')} undo slot(s)")
    for name in ALTERNATIVES:
        ok = by.get(name)
        if ok:
            out.append(f"INFO {name} ({', '.join(f'{k}={v}' for k, v in RMU_ENV[name].items())}; one-kernel chunk "
                       f"{'on' if ok.get('fused_syndrome') else 'off'}, marker writes {ok.get('marker_mode')}, "
                       f"{ok.get('undo_slots')} undo slot(s), write-back overlap "
                       f"{'on' if ok.get('wb_overlap') else 'off'}): "
                       f"update {ok['update_ms']:.1f} ms = {ok['update_ms'] / ref['update_ms']:.2f}x the reference, "
                       f"iteration {100 * (ok['iteration_ms'] / ref['iteration_ms'] - 1):+.2f}%")
    if rmu.get("peak_gpu_gib") is not None:
        d = rmu["peak_gpu_gib"] - ref["peak_gpu_gib"]
        out.append(f"{'PASS' if d <= 0.05 else 'MISS'} peak GPU memory does not grow with RMU: "
                   f"{d:+.2f} GiB vs reference ({rmu['peak_gpu_gib']:.2f} vs "
                   f"{ref['peak_gpu_gib']:.2f} GiB)")
        nl = by.get("rmu_nolend")
        if nl and nl.get("peak_gpu_gib") is not None:
            out.append(f"INFO lending saves {nl['peak_gpu_gib'] - rmu['peak_gpu_gib']:+.2f} GiB of "
                       f"peak GPU memory (RMU buffers {rmu.get('rmu_buffers_mib', 0):.0f} MiB)")
    return out
