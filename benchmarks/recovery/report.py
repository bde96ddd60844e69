"""The Markdown report and the goals, from the harness's result dict (run.py's JSON).

Pure functions: `markdown(res)` -> str, `goals(res)` -> [{goal, ok, detail}].
`python -m benchmarks.recovery.report results.json` prints the report of a saved run again.  The goals are the
issue's targets for one H200; on a CPU machine they are printed but marked informational (only
ratios count there, and not these).
"""
from __future__ import annotations

LETO_RECOVERY_EXTRA_S = 1.0     # "Leto's HOF recovery <= 1 s plus the interrupted iteration"
SPEEDUP_GOAL = 10.0             # ">= 10x faster recovery than torchrun + DCP (async)"
NOISE = 0.15                    # a DCP run's plain step this far from the reference's: load changed


def _s(x, nd=2) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _pct(x) -> str:
    # The model goes negative when recovery takes longer than the time between failures.
    return "n/a" if x is None else ("<= 0" if x <= 0 else f"{100 * x:.1f}%")


def _on_gpu(res: dict) -> bool:
    return res["preset"]["name"].startswith("h200")


def goals(res: dict) -> list[dict]:
    out = []
    leto = res["systems"].get("leto-inplace")
    tr = res["systems"].get("torchrun-dcp-async")
    tag = "" if _on_gpu(res) else " (CPU: informational)"
    if leto and leto.get("failures"):
        t_iter = leto["t_iter"] or 0.0
        recs = [f["recovery"] for f in leto["failures"]]
        ok = bool(recs) and all(r is not None and r <= LETO_RECOVERY_EXTRA_S + t_iter
                                for r in recs)
        out.append({"goal": f"Leto HOF recovery (I + R) <= {LETO_RECOVERY_EXTRA_S:g} s + one "
                            f"iteration{tag}", "ok": ok,
                    "detail": "I + R = " + ", ".join(_s(r) for r in recs)
                              + f" s; iteration {_s(t_iter, 3)} s"})
    if leto and tr and leto.get("recovery_mean") and tr.get("recovery_mean"):
        ratio = tr["recovery_mean"] / leto["recovery_mean"]
        out.append({"goal": f">= {SPEEDUP_GOAL:g}x faster recovery than torchrun + DCP async at "
                            f"its Young interval, measured (MTBF {res['mtbf_s']:g} s){tag}",
                    "ok": ratio >= SPEEDUP_GOAL,
                    "detail": f"{_s(tr['recovery_mean'])} s / {_s(leto['recovery_mean'])} s = "
                              f"{ratio:.1f}x (interval {tr['interval']} steps)"})
        ex_tr, ex_l = tr["extrapolated"], leto["extrapolated"]
        ratio = ex_tr["T_rec"] / ex_l["T_rec"]
        out.append({"goal": f">= {SPEEDUP_GOAL:g}x faster recovery than torchrun + DCP async at "
                            f"its Young interval, extrapolated to MTTF "
                            f"{res['paper_mttf_s']:g} s{tag}", "ok": ratio >= SPEEDUP_GOAL,
                    "detail": f"{_s(ex_tr['T_rec'])} s (measured I {_s(tr['I_mean'])} s + "
                              f"{ex_tr['interval']}/2 + 1 steps) / {_s(ex_l['T_rec'])} s = "
                              f"{ratio:.1f}x"})
    return out


def markdown(res: dict) -> str:
    ref, m, p = res["reference"], res["machine"], res["preset"]
    lines = [
        f"## Recovery time and ETTR: preset `{p['name']}`",
        "",
        f"{p['description']}; **{p.get('nproc', '?')} rank(s)** in this run"
        + "".join(f"; leto-run's workers with `{k}={v}`" for k, v in p.get("leto_env") or ())
        + ".  Machine: "
        f"{m['nproc']} CPUs ({m['cpu']}), Python {m['python']}, "
        f"torch {m['torch']}; leto at {m['leto_tree']}.  Date {res['date_utc']}"
        + "".join(f", continued {c['date_utc']} (`--continue`)" for c in res.get("continued", [])) + ".",
        "",
        f"Reference (no fault tolerance, no failures): {ref['steps']} steps, "
        f"t_iter {_s(ref['t_iter'] * 1e3, 1)} ms, T_ref {_s(ref['T_ref'], 1)} s.  "
        f"Checkpoint cost C (measured in this run): sync {_s(ref['calibration']['sync_cost_s'], 3)}"
        f" s, async {_s(ref['calibration']['async_cost_s'], 3)} s.  Schedule: "
        + ", ".join(f"{kind.upper()} rank {r} at +{t:g} s"
                    for (t, r), kind in zip(res["schedule"], _kinds(res)))
        + f" (MTBF {res['mtbf_s']:g} s); Young interval sqrt(2 C MTBF) / t_iter: sync "
        f"{res['intervals']['sync']['steps']}, async {res['intervals']['async']['steps']} steps"
        + (f"; leto-ckpt (async C, FF-only MTBF {res['intervals']['ff']['mtbf_s']:g} s): "
           f"{res['intervals']['ff']['steps']} steps" if "ff" in res["intervals"] else "")
        + ".",
        "",
        "| system | ckpt every (steps) | t_iter (ms) | failures | I mean (s) | R mean (s) "
        "| I+R mean (s) | I+R vs Leto | ETTR measured | ETTR model, this run "
        f"| ETTR at MTTF {res['paper_mttf_s'] / 60:g} min (model) "
        f"| I+R at MTTF {res['paper_mttf_s'] / 60:g} min (model, s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # "vs Leto": in place under HOF-only schedules, with its checkpoint fallback under mixed ones
    leto = res["systems"].get("leto-inplace") or res["systems"].get("leto-ckpt") or {}
    for name, r in res["systems"].items():
        n_ok = sum(f["recovery"] is not None for f in r["failures"])
        vs = (r["recovery_mean"] / leto["recovery_mean"]
              if r.get("recovery_mean") and leto.get("recovery_mean") else None)
        lines.append(
            f"| {r['label']} | {r['interval'] or '-'} | {_s((r['t_iter'] or 0) * 1e3, 1)} "
            f"| {n_ok}/{len(r['kills'])} | {_s(r.get('I_mean'))} | {_s(r.get('R_mean'))} "
            f"| {_s(r.get('recovery_mean'))} | {'-' if vs is None else f'{vs:.1f}x'} "
            f"| {_pct(r.get('ettr'))} | {_pct((r.get('model_run') or {}).get('ettr'))} "
            f"| {_pct((r.get('extrapolated') or {}).get('ettr'))} "
            f"| {_s((r.get('extrapolated') or {}).get('T_rec'))} |")
    lines += ["", "Per failure (times in s; `at` from the first step; I = t_resume - t_fault, "
              "R = t_{i+1} - t_resume - t_remain):", "",
              "| system | # | kind | rank | at | step i+1 | resumed at | how | I | R | I+R "
              "| breakdown |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["systems"].items():
        for f in r["failures"]:
            lines.append(
                f"| {r['label']} | {f['index'] + 1} | {_kind(f)} | {f['rank']} "
                f"| {_s(f['at_s'])} "
                f"| {f['interrupted_step']} | {f['resumed_step']} | {f['resume'] or '-'} "
                f"| {_s(f['I'])} | "
                + (f">= {_s(f['R_at_least'])}" if f.get("R_at_least") is not None
                   else _s(f['R']))
                + f" | {_s(f['recovery'])} | {_breakdown(f)} |")
    lines += _phase_lines(res)
    for name, why in res.get("skipped", {}).items():
        lines.append(f"\n{name}: skipped ({why})")
    noisy = [r["label"] for r in res["systems"].values()
             if r.get("mode") == "dcp" and r.get("t_iter") and ref.get("t_iter")
             and abs(r["t_iter"] / ref["t_iter"] - 1) > NOISE]
    if noisy:
        lines.append(f"\nWARNING: the plain step of {', '.join(noisy)} differs from the "
                     f"reference's by more than {100 * NOISE:.0f}% (same program): the machine's "
                     "load changed between the runs, so their ETTR against this reference is "
                     "not meaningful (and a kill may have missed a run that ended early).")
    lines += ["", _extrapolation_note(res), ""]
    for g in res.get("goals", []):
        lines.append(f"- {'PASS' if g['ok'] else 'MISS'} {g['goal']}: {g['detail']}")
    return "\n".join(lines)


def _phase_lines(res: dict) -> list[str]:
    """train.py --phases: the first step after each recovery against the steady step, by
    phase (ms wall / ms CPU of the main thread / new allocator segments)."""
    rows = []
    for r in res["systems"].values():
        for f in r["failures"]:
            ph = f.get("first_step_phases")
            if not ph:
                continue
            cells = []
            for name, x in ph["first"].items():
                st = ph["steady"].get(name)
                cells.append(f"{name} {x['s'] * 1e3:.0f}/{x['cpu_s'] * 1e3:.0f}/{x['allocs']}"
                             + (f" (steady {st['s'] * 1e3:.0f}/{st['cpu_s'] * 1e3:.0f}/"
                                f"{st['allocs']:g})" if st else ""))
            rows.append(f"| {r['label']} | {f['index'] + 1} | {ph['step']} | {ph['rank']} "
                        f"| {', '.join(cells)} |")
    if not rows:
        return []
    return ["", "First step after each recovery by phase (train.py --phases; ms wall / ms "
            "main-thread CPU / new allocator segments, the steady steps' medians beside):", "",
            "| system | # | step | rank | phases |", "|---|---|---|---|---|", *rows]


def _kinds(res: dict) -> list[str]:
    return res.get("kinds") or ["hof"] * len(res["schedule"])     # older JSON: HOFs only


def _kind(f: dict) -> str:
    """hof, ff (SIGKILL: the system cannot tell) or ff (page loss, leto-run's injection)."""
    kind = f.get("kind", "hof")
    if kind == "ff":
        return "FF (page loss)" if f.get("inject") else "FF (SIGKILL)"
    return "HOF"


PHASES = ("attach", "localize", "reconstruct", "agree", "finish")   # leto_run.report's order


def _breakdown(f: dict) -> str:
    b = f.get("breakdown") or {}
    det = f"detect {_s(b['detect_s'], 3)}, " if b.get("detect_s") is not None else ""
    rep = f.get("leto_report")
    if rep and rep.get("kind") == "InplaceRecovery":
        ph = rep.get("phases") or {}
        parts = [f"promote {_s(rep.get('promote_s'), 3)}"]
        from leto_run.report import localize_parts_text
        loc = localize_parts_text(rep.get("localize_parts") or {})    # issue 22's parts
        parts += [f"{k} {_s(ph[k], 3)}{loc if k == 'localize' else ''}" for k in PHASES
                  if k in ph]
        how = (f" ({rep['resume']} step {rep.get('resume_step')})" if rep.get("resume")
               else "")
        return det + ", ".join(parts) + how
    fb = f.get("fallback")
    if fb:
        det += f"fallback to step {fb['step']} (failed at {fb['failed_step']}), "
    if b.get("respawn_s") is not None:
        # leto-run loads a fallback's checkpoint inside the runtime: its own report times it
        load = (rep.get("load_s") if rep and rep.get("load_s") is not None else b["load_s"])
        return (f"{det}respawn {_s(b['respawn_s'])}, ready {_s(b['ready_s'])} "
                f"(checkpoint load {_s(load)}), recomputed {f['recomputed_steps']} steps")
    return "-"


def _extrapolation_note(res: dict) -> str:
    return (f"Extrapolation: the schedule is compressed (one SIGKILL every {res['mtbf_s']:g} s); "
            f"the last two columns evaluate ETTR = (t_iter_ref / T_eff) (1 - T_rec / MTTF) at the "
            f"paper's MTTF of {res['paper_mttf_s']:g} s with this run's measurements: "
            "checkpointing systems at Young's interval for that MTTF (T_eff = t_iter + C / K, "
            "T_rec = mean I + L t_iter, L = K/2 sync, K/2 + 1 async; t_iter the reference's), "
            "Leto in place with its own step time and mean I + R (no checkpoints: HOFs only; "
            "leto-ckpt under a mixed schedule: its own step time, checkpoints included, and "
            "the mean I + R over HOFs and FFs alike).  "
            "The column before them checks the model against this run: T_ref / (N T_eff + "
            "failures T_rec) with the interval used here, next to the measured ETTR.")


def main(argv=None) -> int:
    import json
    import sys
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.recovery.report RESULTS.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        print(markdown(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
