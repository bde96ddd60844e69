"""The recovery report: what each failure cost, phase by phase, computed from the event log.

A pure function of the event records (the same JSONL that `--events` writes), so benchmarks and
tests compute exactly what the user sees.  Phases of one restart-mode recovery:

  injected/failed -> detected -> group stopped -> rendezvous done -> workers spawned
  -> first heartbeat (training resumed, at step R) -> back at the pre-failure step F

`recomputed` = F - R steps were trained twice (restart mode reloads the script's last
checkpoint; in-place recovery makes this zero).

An in-place recovery (a `promote` event of generation g+1 follows the failure of generation g)
has its own phases (`InplaceRecovery`):

  injected -> detected -> shadows awake (last `promoted` of g+1) -> [shadows below L3:
  the levels they lacked brought up, `bringup`: "from L1, L2 69 ms, L3 32 ms"] -> attach, localize,
  reconstruct, agree (resume point: finish t / redo t), finish (runtime `phase` events, the
  slowest rank) -> first heartbeat of g+1 (training resumed) -> back at the pre-failure step

A failure that ended the job (no restart, no promotion follows) gets a section that says how it
ended and why (its `decision`); a restart section says why in-place recovery was not used (its
`inplace_fallback`).  Detection is timed from the injection that caused the failure: the last
kill, signal or hang injected into that rank in that generation before it failed (a page loss
only when it struck in the same step: lost pages that trap), never an earlier one.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recovery:
    index: int
    rank: int
    how: str
    generation_from: int
    generation_to: int | None
    failed_step: int | None
    injected: str | None
    detect_s: float | None          # injection -> detection (None when not injected)
    stop_s: float | None            # detection -> every worker of the group stopped
    rendezvous_s: float | None      # stopped -> next rendezvous round complete
    spawn_s: float | None           # detection -> new workers spawned
    resume_s: float | None          # detection -> first heartbeat of the new generation
    resumed_step: int | None
    caught_up_s: float | None       # detection -> back at the failed step
    recomputed_steps: int | None
    fallback: str | None = None     # why in-place recovery was not used (in-place mode)
    exit_code: int | None = None    # the job ended with this failure: its exit code
    end_reason: str | None = None   # ... and the decision that ended it
    checkpoint_step: int | None = None   # a checkpoint fallback: the step it resumed from
    checkpoint_why: str | None = None    # ... the classification and the checkpoint chosen
    load_s: float | None = None     # ... the slowest rank's checkpoint load


@dataclass(frozen=True)
class InplaceRecovery:
    index: int
    rank: int
    how: str
    generation_from: int
    failed_step: int | None
    injected: str | None
    detect_s: float | None          # injection -> detection
    promote_s: float | None         # detection -> last shadow of g+1 awake (`promoted`)
    demote: str | None              # how the survivors left: release | replace | mixed | None
    demote_s: float | None          # release: signal -> the slowest survivor's confirmation
    phases: dict                    # phase name -> seconds (the slowest rank)
    resume: str | None              # finish | redo (from the agree/resume phase)
    resume_step: int | None
    resume_s: float | None          # detection -> first heartbeat of g+1
    resumed_step: int | None
    recomputed_steps: int | None
    caught_up_s: float | None       # detection -> back at the failed step
    total_s: float | None           # injection (or detection) -> training resumed
    level: str | None = None        # the lowest preinit level a promoted shadow started from
    bringup: tuple = ()             # (level name, seconds of the slowest rank) brought up after
    # the slowest rank's localization, by part: probed (device pages), probe_s, sm_s (the state
    # manager's share), remap_s, marker_s (the marker's reconstruction)
    localize_parts: dict = field(default_factory=dict)


PHASES = ("attach", "localize", "reconstruct", "agree", "finish", "resume")
LOCALIZE_PARTS = ("probed", "probe_s", "sm_s", "host_scanned", "host_scan_s", "host_deferred",
                  "commit_s", "remap_s", "marker_s")


def _first(evs, pred):
    return next((e for e in evs if pred(e)), None)


def _cause(events: list[dict], f: dict) -> dict | None:
    """The injection that caused failure `f` (module docstring), or None."""
    t, gen, rank = f["mono"], f["generation"], f["rank"]
    mine = [e for e in events if e["event"] == "inject" and e.get("rank") == rank
            and e["generation"] == gen and e["mono"] <= t + 1e-3 and not e.get("error")]
    hofs = [e for e in mine if not str(e.get("spec", "")).startswith("pages")]
    if hofs:
        return hofs[-1]
    same_step = [e for e in mine if e.get("step") is not None and e.get("step") == f.get("step")]
    return same_step[-1] if same_step else None


def _inplace(index: int, f: dict, inj: dict | None, events: list[dict]) -> InplaceRecovery:
    gen, t = f["generation"], f["mono"]
    nxt = [e for e in events if e["generation"] == gen + 1]
    woke = [e["mono"] for e in nxt if e["event"] == "promoted"]
    phases: dict = {}
    parts: dict = {}
    resume = resume_step = None
    for e in nxt:
        if e["event"] != "phase" or e.get("phase") not in PHASES:
            continue
        if e.get("seconds") is not None:
            if e["phase"] == "localize" and float(e["seconds"]) >= phases.get("localize", -1.0):
                parts = {k: e[k] for k in LOCALIZE_PARTS if e.get(k) is not None}
            phases[e["phase"]] = max(phases.get(e["phase"], 0.0), float(e["seconds"]))
        if e.get("resume") is not None and resume is None:
            resume, resume_step = e["resume"], e.get("step")
    levels = sorted({e["level"] for e in nxt if e["event"] == "promote" and e.get("level")})
    up = {}
    for e in nxt:
        if e["event"] == "phase" and e.get("phase") == "bringup":
            for k in ("l2_s", "l3_s"):
                if e.get(k) is not None:
                    up[k] = max(up.get(k, 0.0), float(e[k]))
    resumed = _first(nxt, lambda e: e["event"] == "resumed")
    caught = _first(nxt, lambda e: e["event"] == "caught_up")
    modes = {("replace" if e.get("reason") else e.get("mode")) for e in events
             if e["event"] == "demote" and e["generation"] == gen and e.get("mode")}
    modes.discard(None)
    confirmed = [e["agent_seconds"] for e in events if e["event"] == "demoted"
                 and e["generation"] == gen and e.get("agent_seconds") is not None]
    failed_step = f.get("step")
    recomputed = None
    if resumed and failed_step is not None and resumed.get("step") is not None:
        recomputed = max(0, failed_step - resumed["step"])
    start = inj["mono"] if inj else t
    return InplaceRecovery(
        index=index, rank=f["rank"], how=f["how"], generation_from=gen, failed_step=failed_step,
        injected=inj.get("spec") if inj else None, detect_s=(t - inj["mono"]) if inj else None,
        promote_s=(max(woke) - t) if woke else None,
        demote=(modes.pop() if len(modes) == 1 else "mixed") if modes else None,
        demote_s=max(confirmed) if confirmed else None, phases=phases, resume=resume,
        resume_step=resume_step, resume_s=resumed["mono"] - t if resumed else None,
        resumed_step=resumed.get("step") if resumed else None, recomputed_steps=recomputed,
        caught_up_s=caught["mono"] - t if caught else None,
        total_s=resumed["mono"] - start if resumed else None,
        level=levels[0] if levels else None,
        bringup=tuple((k[:2].upper(), up[k]) for k in ("l2_s", "l3_s") if k in up),
        localize_parts=parts)


def recoveries(events: list[dict]) -> list:
    """One `Recovery` (restart) or `InplaceRecovery` per generation that failed."""
    out: list = []
    fails = [e for e in events if e["event"] == "failure_detected"]
    seen_gen: set[int] = set()
    for f in fails:
        gen = f["generation"]
        if gen in seen_gen:          # one recovery per generation: the first failure is the cause
            continue
        seen_gen.add(gen)
        inj = _cause(events, f)
        if any(e["event"] == "promote" and e["generation"] == gen + 1 for e in events):
            out.append(_inplace(len(out) + 1, f, inj, events))
            continue
        out.append(_restart(len(out) + 1, f, inj, events))
    return out


def _restart(index: int, f: dict, inj: dict | None, events: list[dict]) -> Recovery:
    gen, t = f["generation"], f["mono"]
    later = [e for e in events if e["mono"] >= t]

    def after(name: str, g: int, **match) -> dict | None:
        return _first(later, lambda e: e["event"] == name and e["generation"] == g
                      and all(e.get(k) == v for k, v in match.items()))

    stop = after("stop", gen)
    stopped = [e for e in later if e["event"] == "exit" and e["generation"] == gen]
    rdzv = after("rendezvous", gen + 1)
    # Shadows of gen + 1 may have been spawned before the failure: the respawn is an active's.
    spawn = _first(later, lambda e: e["event"] == "spawn" and e["generation"] == gen + 1
                   and e.get("role") != "shadow") if rdzv else None
    resumed = after("resumed", gen + 1) if rdzv else None
    caught = after("caught_up", gen + 1) if rdzv else None
    fallback = after("inplace_fallback", gen)
    ckpt = after("fallback", gen)
    loads = [e.get("seconds") for e in later if e["event"] == "phase"
             and e.get("phase") == "checkpoint_load" and e["generation"] == gen + 1]
    end = None if rdzv else after("job_end", gen)
    decision = _first([e for e in later if e["event"] == "decision" and e["generation"] == gen
                       and e.get("action") != "inplace"], lambda e: True)
    failed_step = f.get("step")
    stop_end = max((e["mono"] for e in stopped), default=None) if stop else None

    def dt(e):
        return None if e is None else e["mono"] - t

    return Recovery(
        index=index, rank=f["rank"], how=f["how"], generation_from=gen,
        generation_to=gen + 1 if spawn else None, failed_step=failed_step,
        injected=inj.get("spec") if inj else None,
        detect_s=(t - inj["mono"]) if inj else None,
        stop_s=None if stop_end is None else stop_end - t,
        rendezvous_s=None if rdzv is None else rdzv.get("seconds"),
        spawn_s=dt(spawn), resume_s=dt(resumed),
        resumed_step=resumed.get("step") if resumed else None,
        caught_up_s=dt(caught),
        recomputed_steps=(failed_step - resumed["step"]
                          if resumed and failed_step is not None
                          and resumed.get("step") is not None else None),
        fallback=fallback.get("reason") if fallback else None,
        exit_code=end.get("exit_code") if end else None,
        end_reason=(decision or end or {}).get("reason") if end else None,
        checkpoint_step=ckpt.get("step") if ckpt else None,
        checkpoint_why=ckpt.get("reason") if ckpt else None,
        load_s=max((x for x in loads if x is not None), default=None))


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _inplace_lines(r: InplaceRecovery) -> list[str]:
    head = (f"  #{r.index} generation {r.generation_from}->{r.generation_from + 1} in place: "
            f"rank {r.rank} {r.how}"
            + (f" at step {r.failed_step}" if r.failed_step is not None else ""))
    if r.injected:
        head += f"  [injected: {r.injected}]"
    ph = r.phases.get
    point = (f" ({r.resume} step {r.resume_step})" if r.resume and r.resume_step is not None
             else f" ({r.resume})" if r.resume else "")
    demote = ""
    if r.demote == "release" or (r.demote == "mixed" and r.demote_s is not None):
        demote = f" | demotion {_ms(r.demote_s)} ({r.demote}, in process)"
    elif r.demote:
        demote = f" | demotion: {r.demote}"
    level = ""
    if r.level:
        level = f" | from {r.level}" + "".join(f", {name} {_ms(sec)}" for name, sec in r.bringup)
    body = (f"     detection {_ms(r.detect_s)}{demote} | promotion +{_ms(r.promote_s)}{level} | attach "
            f"{_ms(ph('attach'))} | localization {_ms(ph('localize'))}"
            f"{localize_parts_text(r.localize_parts)} | reconstruction "
            f"{_ms(ph('reconstruct'))} | agreement {_ms(ph('agree'))}{point} | finish "
            f"{_ms(ph('finish'))} | training resumed +{_ms(r.resume_s)}"
            + (f" at step {r.resumed_step}" if r.resumed_step is not None else "")
            + (f" | recomputed {r.recomputed_steps} step(s)"
               if r.recomputed_steps is not None else "")
            + (f" | back at step {r.failed_step} +{_ms(r.caught_up_s)}"
               if r.failed_step is not None else "")
            + f" | total {_ms(r.total_s)}")
    return [head, body]


def localize_parts_text(parts: dict) -> str:
    """" (probe 0.9 ms for 3,300 pages, state manager 1.2 ms, remap 0.0 ms, marker 0.4 ms)",
    or "" for a localization that did not report its parts."""
    if not parts:
        return ""
    got = []
    if parts.get("probe_s") is not None:
        pages = f" for {parts['probed']:,} pages" if parts.get("probed") is not None else ""
        got.append(f"probe {_ms(parts['probe_s'])}{pages}")
    for k, name in (("sm_s", "state manager"), ("remap_s", "remap"), ("marker_s", "marker")):
        if parts.get(k) is not None:
            got.append(f"{name} {_ms(parts[k])}{_sm_parts(parts) if k == 'sm_s' else ''}")
    return f" ({', '.join(got)})" if got else ""


def _sm_parts(parts: dict) -> str:
    """" [host scan 0.2 ms for 4 pages, 150 deferred; commit 0.0 ms]", or "" without them."""
    if parts.get("host_scan_s") is None:
        return ""
    n = f" for {parts['host_scanned']:,} pages" if parts.get("host_scanned") is not None else ""
    later = f", {parts['host_deferred']:,} deferred" if parts.get("host_deferred") else ""
    commit = f"; commit {_ms(parts['commit_s'])}" if parts.get("commit_s") is not None else ""
    return f" [host scan {_ms(parts['host_scan_s'])}{n}{later}{commit}]"


def memory_lines(events: list[dict]) -> list[str]:
    """What the step-boundary guard repaired and what the scrub found (runtime `phase` events
    `repair` and `scrub`; leto_runtime/rmu/guard.py, scrub.py), and each rank's scrub total."""
    out = []
    for e in events:
        if e.get("event") != "phase" or e.get("phase") not in ("repair", "scrub"):
            continue
        who = f"  rank {e.get('rank')} gen {e.get('generation')} step {e.get('step')}: "
        if e["phase"] == "repair":
            what = [f"parity recomputed from the data for {n} group {g}"
                    for n, g in e.get("reencoded") or []]
            what += [f"{k} data page(s) of {n} group {g} decoded from parity"
                     for n, g, k in e.get("decoded") or []]
            out.append(who + f"{e.get('pages')} lost page(s) repaired before any use: "
                       + ("; ".join(what) or "nothing to rebuild")
                       + f" ({_ms(e.get('seconds'))})")
        elif e.get("action") == "summary":
            out.append(f"  scrub, rank {e.get('rank')} gen {e.get('generation')}: "
                       f"{e.get('slices')} slice(s), {(e.get('bytes') or 0) / 2**20:.1f} MiB "
                       f"checked ({e.get('passes')} full pass(es)) in {_ms(e.get('seconds'))}, "
                       f"{e.get('repaired')} re-encoded")
        elif e.get("action") != "ok":
            out.append(who + f"scrub: {e.get('state')} group {e.get('group')}: "
                       f"{e.get('reason')} -> {e.get('action')}")
    return out


def format_report(events: list[dict]) -> str:
    recs = recoveries(events)
    found = memory_lines(events)
    mem = (["", "Retained memory (losses repaired at step boundaries, the scrub)"] + found
           if found and (recs or any(not x.startswith("  scrub,") for x in found)) else [])
    if not recs:
        return "\n".join(mem)
    if any(isinstance(r, InplaceRecovery) or r.checkpoint_step is not None for r in recs):
        lines = ["", "Recovery report (in place: shadows promoted; restart: stop all, "
                 "rendezvous, respawn; checkpoint fallback: the same with fresh retained "
                 "memory, from the newest complete checkpoint)"]
    else:
        lines = ["", "Recovery report (restart mode: stop all, rendezvous, respawn, reload "
                 "checkpoint)"]
    for r in recs:
        lines += _inplace_lines(r) if isinstance(r, InplaceRecovery) else _restart_lines(r)
    return "\n".join(lines + mem)


def _restart_lines(r: Recovery) -> list[str]:
    head = (f"  #{r.index} generation {r.generation_from}->"
            f"{r.generation_to if r.generation_to is not None else 'end'}: rank {r.rank} "
            f"{r.how}" + (f" at step {r.failed_step}" if r.failed_step is not None else ""))
    if r.injected:
        head += f"  [injected: {r.injected}]"
    if r.checkpoint_step is not None:
        head += f" -> checkpoint fallback to step {r.checkpoint_step}"
    if r.generation_to is None:
        out = [head, f"     detection {_ms(r.detect_s)} | group stopped +{_ms(r.stop_s)} | "
                     + (f"job ended with exit code {r.exit_code}" if r.exit_code is not None
                        else "no restart followed")]
        if r.end_reason:
            out.append(f"     why: {r.end_reason}")
        elif r.fallback:
            out.append(f"     no in-place recovery: {r.fallback}")
        return out
    body = (f"     detection {_ms(r.detect_s)} | group stopped +{_ms(r.stop_s)} | rendezvous "
            f"{_ms(r.rendezvous_s)} | respawned +{_ms(r.spawn_s)}"
            + (f" | checkpoint load {_ms(r.load_s)}" if r.checkpoint_step is not None else "")
            + " | training resumed "
            f"+{_ms(r.resume_s)}"
            + (f" at step {r.resumed_step}" if r.resumed_step is not None else "")
            + (f" | back at step {r.failed_step} +{_ms(r.caught_up_s)}"
               if r.failed_step is not None else "")
            + (f" | recomputed {r.recomputed_steps} step(s)"
               if r.recomputed_steps is not None else ""))
    out = [head, body]
    if r.checkpoint_why:
        out.append(f"     why: {r.checkpoint_why}")
    elif r.fallback:
        out.append(f"     no in-place recovery: {r.fallback}")
    return out
