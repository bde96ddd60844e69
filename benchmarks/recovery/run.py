"""Recovery time and ETTR: Leto in place next to torchrun + DCP, in one run (issue 6).

    python -m benchmarks.recovery --preset cpu-smoke|cpu|h200 [--json FILE] [--md FILE]
    python -m benchmarks.recovery --preset cpu --mixed [--systems leto-ckpt,torchrun-dcp-async]
    python -m benchmarks.recovery.plot FILE.json [--png FILE]      # the figure, from the JSON

Role: the harness.  One invocation:

1. runs the **reference**: the GPT under torchrun with no fault tolerance and no failures.  It
   sizes the run (N steps of about (kills + 1) * MTBF seconds) and, after its timed window,
   measures the cost C of one DCP checkpoint, synchronous and asynchronous (train.py);
2. computes **Young's interval** K* = sqrt(2 C MTBF) / t_iter for each (metrics.py), MTBF the
   schedule's spacing of failures;
3. runs every **system** (systems.py) for the same N steps under the same SIGKILL schedule,
   delivered by the harness to the victim rank's current trainer (launch.py);
4. computes per failure I, R and I + R, per run the ETTR against the reference, and the ETTR
   model evaluated at the compressed MTBF (a check against the measurement) and at the paper's
   one failure per 10 minutes (the extrapolation); writes the JSON (after every system, so a
   run cut short keeps what it measured), the Markdown tables and PASS/MISS lines.

`--mixed`: half of the failures are FFs (not recoverable in place), alternating with HOFs;
the default systems are then leto-ckpt and torchrun + DCP async (mixed.py: what an FF is for
each, and leto-ckpt's checkpoint interval at the FF-only MTBF).

`--continue FILE` goes on with the run whose JSON is FILE: same preset, same machine, same
Leto sources (checked, by digest; the reference's step records travel in the JSON), its
reference and intervals reused, only the systems FILE does not have yet are run.  One device call (10 minutes
on the lent H200) does not hold the reference and all four systems of the `h200` preset; two
calls do, as one run.

Exit status: 0 when the reference and every system ran to completion with every kill measured,
1 otherwise (the JSON and the launcher log tails say why), 2 on usage errors.  No process
outlives the harness (launch.py), Ctrl-C included.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace

from benchmarks.provenance import machine_info
from benchmarks.recovery import metrics as M
from benchmarks.recovery import mixed as X
from benchmarks.recovery import presets, report, systems
from benchmarks.recovery.args import parse_args
from benchmarks.recovery.launch import Launch, run_system

MIN_SYSTEM_S = 20.0      # a system is not started with less budget left (or 1.5 x the training)
WALL_MARGIN = 1.1        # ... or than 1.1 x the longest wall time of its kind measured so far


def system_fits(left_s: float, train_seconds: float, mode: str,
                walls: dict[str, float]) -> tuple[bool, str]:
    """Whether a system of train.py mode `mode` should start with `left_s` of the budget left,
    and why.  `walls`: the longest launch wall time measured so far per mode ("ref" for the
    reference, which also calibrates, so it is an upper bound for a first system of a kind).
    A system started without the time to finish is stopped by the budget's timeout and leaves
    a partial run that a --continue call cannot redo; skipped, it can."""
    need = max(MIN_SYSTEM_S, 1.5 * train_seconds)
    basis = f"1.5 x the {train_seconds:.0f} s of training"
    known = walls.get(mode) or walls.get("ref")
    if known and WALL_MARGIN * known > need:
        need = WALL_MARGIN * known
        basis = (f"{WALL_MARGIN:g} x the longest {mode} system so far ({known:.0f} s)" if walls.get(mode)
                 else f"{WALL_MARGIN:g} x the reference's {known:.0f} s")
    if left_s < need:
        return False, f"time budget: {left_s:.0f} s left, needs ~{need:.0f} s ({basis})"
    return True, f"{left_s:.0f} s left, needs ~{need:.0f} s ({basis})"


def walls(res: dict) -> dict[str, float]:
    """The longest launch wall time per train.py mode among the systems in `res` so far."""
    out: dict[str, float] = {}
    runs = [("ref", res.get("reference"))] + [(r.get("mode"), r) for r in res.get("systems", {}).values()]
    for mode, r in runs:
        w = ((r or {}).get("launch") or {}).get("wall_s")
        if mode and w:
            out[mode] = max(out.get(mode, 0.0), float(w))
    return out


def log(msg: str) -> None:
    print(f"[recovery {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timeline(records: list[dict], t0: float) -> list[list]:
    """Rank 0's steps for the plot: [step, start, end, checkpoint kind, pid], times from t0."""
    return [[r["step"], round(r["t0"] - t0, 4), round(r["t1"] - t0, 4), r.get("ckpt"), r["pid"]]
            for r in sorted(M.steps_of(records), key=lambda r: r["t0"]) if r["rank"] == 0]


def of_ev(records: list[dict], ev: str) -> list[dict]:
    return [r for r in records if r.get("ev") == ev]


def leto_events(run_dir: str) -> list[dict]:
    from leto_run.events import read_events
    path = os.path.join(run_dir, "events.jsonl")
    return read_events(path) if os.path.exists(path) else []


def leto_phases(events: list[dict]) -> list[dict]:
    """leto-run's own recovery report (from its event log), one entry per recovery."""
    from leto_run.report import recoveries
    return [asdict(r) | {"kind": type(r).__name__} for r in recoveries(events)]


def leto_detect_s(events: list[dict], pid: int, t_fault: float) -> float | None:
    """SIGKILL -> leto-run's `failure_detected` of that pid (same monotonic clock)."""
    e = next((e for e in events if e["event"] == "failure_detected" and e.get("pid") == pid),
             None)
    return None if e is None else e["mono"] - t_fault


def launch_summary(ln: Launch) -> dict:
    return {"argv": ln.argv, "command": shlex.join(ln.argv), "exit_code": ln.exit_code,
            "timed_out": ln.timed_out, "wall_s": ln.wall_s,
            "launch_to_first_step_s": (ln.t_first_step - ln.t_launch) if ln.t_first_step else None,
            "log_tail": ln.log_tail if (ln.exit_code != 0) else ""}


def run_reference(preset, work: str, env: dict, timeout: float) -> tuple[dict, list[dict]]:
    sysm = systems.REFERENCE
    run_dir = os.path.join(work, sysm.name)
    argv = systems.argv(sysm, preset, run_dir, calibrate=True)
    log(f"{sysm.name}: {shlex.join(argv)}")
    ln = run_system(argv, systems.launcher_env(sysm, env), run_dir, [], timeout,
                    progress=lambda m: log(f"  {m}"))
    out = {"system": sysm.name, "label": sysm.label, "launch": launch_summary(ln)}
    recs = ln.records
    plan = of_ev(recs, "plan")
    calib = {r["rank"]: r for r in of_ev(recs, "calib")}
    t0 = M.t_start(recs)
    ok = ln.exit_code == 0 and plan and calib and t0 is not None
    out["ok"] = bool(ok)
    if not ok:
        return out, recs
    n = plan[0]["steps"]
    # The costs of the slowest rank: a checkpoint ends for everyone when the last rank is done.
    c_sync = max(c["sync_cost"] for c in calib.values())
    c_async = max(c["async_cost"] for c in calib.values())
    out.update(steps=n, tokens_per_step=plan[0]["tokens_per_step"], t_iter=M.step_time(recs), T_ref=M.completion(recs, n - 1) - t0,
               plan=plan[0], calibration={"sync_cost_s": c_sync, "async_cost_s": c_async,
                                          "per_rank": calib},
               timeline=timeline(recs, t0), records=recs)
    return out, recs


class ContinueError(ValueError):
    """`--continue FILE` names a run this invocation cannot continue."""


# What must be equal for two calls to count as one run (machine_info() keys).
SAME_MACHINE = ("nproc", "cpu", "python", "torch", "leto_sources", "platform")


def continued(path: str, preset, machine: dict) -> dict:
    """The earlier run's result dict, checked to be continuable by this invocation."""
    try:
        with open(path, encoding="utf-8") as f:
            prev = json.load(f)
    except (OSError, ValueError) as e:
        raise ContinueError(f"--continue {path}: cannot read it as a harness JSON ({e})") from e
    if prev.get("benchmark") != "recovery" or not isinstance(prev.get("preset"), dict):
        raise ContinueError(f"--continue {path}: not a JSON of this harness")
    want = {k: v for k, v in json.loads(json.dumps(asdict(preset))).items() if k != "budget_s"}
    have = {k: v for k, v in prev["preset"].items() if k != "budget_s"}
    have.setdefault("kinds", ["hof"])       # a JSON from before mixed schedules: HOFs only
    have.setdefault("leto_env", [])         # ... and from before --leto-env
    diff = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    if diff:
        raise ContinueError(f"--continue {path}: its run used other preset settings ({', '.join(diff)}: "
                            f"{[have.get(k) for k in diff]} there, {[want.get(k) for k in diff]} "
                            "here); pass the same --preset and overrides, or start a new run")
    other = [k for k in SAME_MACHINE if prev["machine"].get(k) != machine.get(k)]
    if other:
        raise ContinueError(f"--continue {path}: measured on another machine or code ("
                            + ", ".join(f"{k} {prev['machine'].get(k)!r} there, {machine.get(k)!r} here"
                                        for k in other) + "); start a new run")
    ref = prev.get("reference") or {}
    if not ref.get("ok") or "records" not in ref or "intervals" not in prev:
        raise ContinueError(f"--continue {path}: it has no complete reference with its step "
                            "records (the reference failed, or the file predates --continue); "
                            "start a new run")
    return prev


def evaluate(sysm, preset, ln: Launch, ref: dict, ref_recs: list[dict], interval: int | None,
             cost: float | None) -> dict:
    recs = ln.records
    t0 = M.t_start(recs)
    t_iter = M.step_time(recs)
    out = {"system": sysm.name, "label": sysm.label, "launcher": sysm.launcher,
           "mode": sysm.mode, "ckpt": sysm.ckpt, "interval": interval,
           "ckpt_cost_s": cost, "ckpt_call_s": M.ckpt_cost(recs), "t_iter": t_iter,
           "launch": launch_summary(ln), "kills": [asdict(k) for k in ln.kills]}
    delivered = [k for k in ln.kills if k.t_fault is not None]
    fails = []
    events = leto_events(ln.run_dir) if sysm.launcher == systems.LETO else []
    phases = leto_phases(events)
    for j, k in enumerate(delivered):
        nxt = delivered[j + 1].t_fault if j + 1 < len(delivered) else None
        f = M.failure(recs, k.t_fault, t_iter or 0.0, nxt)
        rel = (lambda t: None if t is None or t0 is None else t - t0)
        f.update(index=k.index, rank=k.rank, pid=k.pid, at_s=rel(k.t_fault),
                 resume_at_s=rel(f["t_resume"]), done_at_s=rel(f["t_done"]),
                 kill_delay_s=k.delay_s, kind=k.kind, inject=k.inject, aimed_at_s=rel(k.aimed_at))
        f["breakdown"] = M.restart_breakdown(recs, f)
        f["first_step_phases"] = M.first_step_phases(recs, f)
        if events:
            f["breakdown"]["detect_s"] = leto_detect_s(events, k.pid, k.t_fault)
        if k.inject is not None:
            X.ff_fallback(f, X.fallback_after(events, k.t_fault))
        if j < len(phases):
            f["leto_report"] = phases[j]
        fails.append(f)
    out["failures"] = fails
    out["leto_recoveries"] = phases
    e = M.ettr(recs, ref_recs)
    out.update(e)
    n = ref["steps"]
    done = [f for f in fails if f["recovery"] is not None]
    # Complete: every kill was delivered, the group came back from each (t_resume), and the run
    # trained to its last step.  A failure that had not caught up when the next kill struck
    # ("rollback, not caught up": R only bounded below) is a measured outcome of the schedule
    # -- a checkpointing system whose Young interval is longer than the MTBF rolls back past
    # the previous fault -- not an incomplete run.
    out["complete"] = (ln.exit_code == 0 and e["step"] == n - 1 and len(delivered) == len(ln.kills)
                       and all(f["t_resume"] is not None for f in fails))
    if done and t_iter:
        rec = statistics.mean(f["recovery"] for f in done)
        # I is known for every failure the group came back from, caught up or not.
        init = statistics.mean(f["I"] for f in fails if f["I"] is not None)
        out.update(I_mean=init, R_mean=statistics.mean(f["R"] for f in done), recovery_mean=rec)
        kw = dict(t_iter_ref=ref["t_iter"], t_iter=t_iter, init_s=init)
        if sysm.mode == "dcp":
            kw.update(ckpt=sysm.ckpt, cost_s=cost)
        else:
            kw.update(recovery_s=rec)
        # every failure cost the run its recovery, caught up before the next one or not
        out["model_run"] = M.model_run(steps=n, failures=len(fails), T_ref=ref["T_ref"],
                                       mttf_s=preset.mtbf_s, interval=interval, **kw)
        out["extrapolated"] = M.model_ettr(mttf_s=M.PAPER_MTTF_S, **kw)
    out["timeline"] = timeline(recs, t0) if t0 is not None else []
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _continue_run(prev: dict, a, now: str, command: list[str]) -> tuple[dict, tuple]:
    """The same run, one more call: its reference, intervals and systems stand.  Returns the
    result dict and the basis (reference, its step records, interval K and cost per kind)."""
    res = dict(prev, continued=[*prev.get("continued", []),
                                {"date_utc": now, "command": command}])
    res["skipped"] = {k: v for k, v in prev.get("skipped", {}).items()
                      if k not in {s.name for s in a.system_list}}
    ref = res["reference"]
    K = {k: v["steps"] for k, v in res["intervals"].items()}
    cost = {k: v["cost_s"] for k, v in res["intervals"].items()}
    log(f"continuing the run of {prev['date_utc']} ({a.cont}): reference and "
        f"{', '.join(res['systems']) or 'no system'} kept")
    return res, (ref, ref["records"], K, cost)


def _reference_and_intervals(res: dict, preset, work: str, env: dict, timeout: float,
                             save) -> tuple | None:
    """Run the reference, then Young's interval per checkpoint kind from its costs; both into
    `res` (saved after each).  Returns the basis as _continue_run does, None if it failed."""
    ref, ref_recs = run_reference(preset, work, env, timeout)
    res["reference"] = ref
    save()
    if not ref["ok"]:
        log(f"reference failed (exit {ref['launch']['exit_code']}):\n"
            f"{ref['launch']['log_tail']}")
        return None
    c = ref["calibration"]
    K = {"sync": M.young_interval(c["sync_cost_s"], preset.mtbf_s, ref["t_iter"]),
         "async": M.young_interval(c["async_cost_s"], preset.mtbf_s, ref["t_iter"])}
    cost = {"sync": c["sync_cost_s"], "async": c["async_cost_s"]}
    res["intervals"] = {k: {"steps": K[k], "cost_s": cost[k], "mtbf_s": preset.mtbf_s,
                            "t_iter_s": ref["t_iter"]} for k in K}
    if preset.ff_fraction > 0:
        # leto-ckpt: checkpoints serve FFs only (HOFs recover in place), so Young's interval at
        # the FF-only MTBF, from the same calibrated async cost.
        mtbf_ff = X.ff_mtbf(preset.mtbf_s, preset.ff_fraction)
        K["ff"] = X.ff_interval(c["async_cost_s"], preset.mtbf_s, preset.ff_fraction,
                                ref["t_iter"])
        cost["ff"] = c["async_cost_s"]
        res["intervals"]["ff"] = {"steps": K["ff"], "cost_s": cost["ff"], "mtbf_s": mtbf_ff,
                                  "t_iter_s": ref["t_iter"]}
        log(f"leto-ckpt: Young interval at the FF-only MTBF {mtbf_ff:g} s: {K['ff']} steps")
    log(f"reference: {ref['steps']} steps, t_iter {ref['t_iter'] * 1e3:.1f} ms, "
        f"T_ref {ref['T_ref']:.1f} s; checkpoint cost sync {cost['sync'] * 1e3:.0f} ms, "
        f"async {cost['async'] * 1e3:.0f} ms -> Young interval at MTBF "
        f"{preset.mtbf_s:g} s: sync {K['sync']}, async {K['async']} steps")
    save()
    return ref, ref_recs, K, cost


def _run_faulted(sysm, preset, work: str, env: dict, basis: tuple, timeout: float) -> dict:
    """One faulted system for the reference's steps under the kill schedule, evaluated."""
    ref, ref_recs, K, cost = basis
    run_dir = os.path.join(work, sysm.name)
    k = K[sysm.ckpt] if sysm.mode == "dcp" else (K["ff"] if sysm.checkpoint else None)
    sched, specs = _schedule_of(sysm, preset, ref["t_iter"], k, cost.get("async"))
    argv_ = systems.argv(sysm, preset, run_dir, steps=ref["steps"], interval=k,
                         injects=tuple(x for x in specs if x))
    log(f"{sysm.name}: {shlex.join(argv_)}")
    ev = (os.path.join(run_dir, "events.jsonl")
          if sysm.launcher == systems.LETO and sysm.recovery == "inplace" else None)
    ln = run_system(argv_, systems.launcher_env(sysm, env, preset.leto_env), run_dir, sched,
                    timeout, progress=lambda m: log(f"  {m}"),
                    events_path=ev, nproc=preset.nproc, kill_phase=preset.kill_phase)
    r = evaluate(sysm, preset, ln, ref, ref_recs, k,
                 cost[sysm.ckpt] if sysm.mode == "dcp" else None)
    r["launcher_env_extra"] = {key: v for key, v in
                               systems.launcher_env(sysm, {}, preset.leto_env).items()}
    log(f"{sysm.name}: exit {ln.exit_code}, ETTR "
        f"{(r['ettr'] or 0) * 100:.1f}%, recovery I+R "
        + ", ".join(f"{f['recovery']:.2f} s" if f["recovery"] is not None else "n/a"
                    for f in r["failures"]))
    if not r["complete"]:
        log(f"{sysm.name}: incomplete run; launcher log tail:\n{ln.log_tail}")
    shutil.rmtree(os.path.join(run_dir, "ckpt"), ignore_errors=True)   # disk, on GPUs
    return r


def _schedule_of(sysm, preset, t_iter_ref: float, interval: int | None,
                 cost_s: float | None = None) -> tuple[list, list]:
    """run_system's schedule for `sysm` -- (offset, rank, kind, inject spec or None) per kill --
    and the specs alone.  Only leto-ckpt's FFs are injections (mixed.py); every other failure
    is the harness's SIGKILL.  Warns when the first FF may find no complete checkpoint (then
    leto-run ends the job with exit 4): fewer steps after the first one than its write takes,
    the calibrated async cost `cost_s` standing in for that."""
    kinds = preset.kill_kinds()
    specs = (X.ff_specs(preset.schedule(), kinds, t_iter_ref, preset.leto_args)
             if sysm.checkpoint else [None] * len(kinds))
    if sysm.checkpoint:
        margin = X.first_ff_margin(specs, interval)
        if margin is not None and margin * t_iter_ref < max(cost_s or 0.0, t_iter_ref):
            log(f"{sysm.name}: WARNING the first FF comes {margin} steps after the first "
                f"checkpoint (step {interval}), which may not be complete by then (async "
                f"cost {cost_s or 0:.2f} s): raise --mtbf")
    sched = [(off, rank, kind, spec)
             for (off, rank), kind, spec in zip(preset.schedule(), kinds, specs)]
    return sched, specs


def _finish(res: dict, a, prev: dict | None, t_begin: float, save) -> None:
    """The goals and the wall time into `res` (saved), the Markdown report out."""
    res["goals"] = report.goals(res)
    res["wall_s"] = time.monotonic() - t_begin
    if prev is not None:
        res["continued"][-1]["wall_s"] = res["wall_s"]
        res["wall_s"] += prev.get("wall_s") or 0.0
    save()
    md = report.markdown(res)
    print(md)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(md + "\n")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    leto_args = None if a.leto_args is None else tuple(shlex.split(a.leto_args))
    preset = presets.get(a.preset, mtbf_s=a.mtbf, kills=a.kills, budget_s=a.budget, nproc=a.nproc,
                         kill_phase=a.kill_phase, leto_args=leto_args,
                         leto_env=a.leto_env_pairs or None,
                         kinds=presets.MIXED if a.mixed else None)
    if a.phases:
        preset = replace(preset, model_args=(*preset.model_args, "--phases"))
    if a.profile:
        preset = replace(preset, model_args=(*preset.model_args, "--profile"))
    for sysm in a.system_list:
        why = systems.schedule_problem(sysm, preset.kill_kinds())
        if why:
            print(f"error: --systems: {why}", file=sys.stderr)
            return 2
    t_begin = time.monotonic()
    budget = preset.budget_s or float("inf")
    work = a.work_dir or tempfile.mkdtemp(prefix="leto-recovery-")
    os.makedirs(work, exist_ok=True)
    env = systems.environment(preset)
    # SIGTERM (a CI timeout, the device tool) tears down like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    command = [sys.executable, "-m", "benchmarks.recovery", *(sys.argv[1:] if argv is None else argv)]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    machine = machine_info()
    prev = None
    if a.cont:
        try:
            prev = continued(a.cont, preset, machine)
        except ContinueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    res = {"benchmark": "recovery", "command": command, "date_utc": now,
           "machine": machine, "preset": asdict(preset),
           "train_seconds": preset.train_seconds, "schedule": preset.schedule(),
           "kinds": preset.kill_kinds(),
           "mtbf_s": preset.mtbf_s, "paper_mttf_s": M.PAPER_MTTF_S, "work_dir": work,
           "reference": None, "systems": {}, "skipped": {}}

    def save():
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=1, default=str)

    ok = True
    try:
        if prev is not None:
            res, basis = _continue_run(prev, a, now, command)
        else:
            left = budget - (time.monotonic() - t_begin)
            basis = _reference_and_intervals(res, preset, work, env,
                                             min(preset.system_timeout_s, left), save)
            if basis is None:
                return 1
        for sysm in a.system_list:
            if sysm.name in res["systems"]:
                log(f"{sysm.name}: measured in the run being continued")
                ok &= bool(res["systems"][sysm.name].get("complete"))
                continue
            left = budget - (time.monotonic() - t_begin)
            fits, why = system_fits(left, preset.train_seconds, sysm.mode, walls(res))
            if not fits:
                res["skipped"][sysm.name] = why
                log(f"{sysm.name}: skipped ({why})")
                ok = False
                continue
            r = _run_faulted(sysm, preset, work, env, basis, min(preset.system_timeout_s, left))
            res["systems"][sysm.name] = r
            ok &= r["complete"]
            save()
        _finish(res, a, prev, t_begin, save)
        return 0 if ok else 1
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
