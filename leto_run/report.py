"""The recovery report: what each failure cost, phase by phase, computed from the event log.

A pure function of the event records (the same JSONL that `--events` writes), so benchmarks and
tests compute exactly what the user sees.  Phases of one restart-mode recovery:

  injected/failed -> detected -> group stopped -> rendezvous done -> workers spawned
  -> first heartbeat (training resumed, at step R) -> back at the pre-failure step F

`recomputed` = F - R steps were trained twice (restart mode reloads the script's last
checkpoint; in-place recovery makes this zero).

An in-place recovery (a `promote` event of generation g+1 follows the failure of generation g)
has its own phases (`InplaceRecovery`):

  injected -> detected -> shadows awake (last `promoted` of g+1) -> attach, localize,
  reconstruct, agree (resume point: finish t / redo t), finish (runtime `phase` events, the
  slowest rank) -> first heartbeat of g+1 (training resumed) -> back at the pre-failure step
"""
from __future__ import annotations

from dataclasses import dataclass


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


PHASES = ("attach", "localize", "reconstruct", "agree", "finish", "resume")


def _first(evs, pred):
    return next((e for e in evs if pred(e)), None)


def _inplace(index: int, f: dict, inj: dict | None, events: list[dict]) -> InplaceRecovery:
    gen, t = f["generation"], f["mono"]
    nxt = [e for e in events if e["generation"] == gen + 1]
    woke = [e["mono"] for e in nxt if e["event"] == "promoted"]
    phases: dict = {}
    resume = resume_step = None
    for e in nxt:
        if e["event"] != "phase" or e.get("phase") not in PHASES:
            continue
        if e.get("seconds") is not None:
            phases[e["phase"]] = max(phases.get(e["phase"], 0.0), float(e["seconds"]))
        if e.get("resume") is not None and resume is None:
            resume, resume_step = e["resume"], e.get("step")
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
        total_s=resumed["mono"] - start if resumed else None)


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
        t = f["mono"]
        inj = _first(events, lambda e: e["event"] == "inject" and e.get("rank") == f["rank"]
                     and e["generation"] == gen and e["mono"] <= t + 1e-3)
        if any(e["event"] == "promote" and e["generation"] == gen + 1 for e in events):
            out.append(_inplace(len(out) + 1, f, inj, events))
            continue
        stop = _first(events, lambda e: e["event"] == "stop" and e["generation"] == gen)
        stopped = [e for e in events if e["event"] == "exit" and e["generation"] == gen]
        rdzv = _first(events, lambda e: e["event"] == "rendezvous" and e["generation"] == gen + 1)
        spawn = _first(events, lambda e: e["event"] == "spawn" and e["generation"] == gen + 1)
        resumed = _first(events, lambda e: e["event"] == "resumed" and e["generation"] == gen + 1)
        caught = _first(events, lambda e: e["event"] == "caught_up" and e["generation"] == gen + 1)
        failed_step = f.get("step")
        stop_end = max((e["mono"] for e in stopped), default=None) if stop else None

        def dt(e):
            return None if e is None else e["mono"] - t

        out.append(Recovery(
            index=len(out) + 1, rank=f["rank"], how=f["how"], generation_from=gen,
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
                              and resumed.get("step") is not None else None)))
    return out


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
    body = (f"     detection {_ms(r.detect_s)}{demote} | promotion +{_ms(r.promote_s)} | attach "
            f"{_ms(ph('attach'))} | localization {_ms(ph('localize'))} | reconstruction "
            f"{_ms(ph('reconstruct'))} | agreement {_ms(ph('agree'))}{point} | finish "
            f"{_ms(ph('finish'))} | training resumed +{_ms(r.resume_s)}"
            + (f" at step {r.resumed_step}" if r.resumed_step is not None else "")
            + (f" | recomputed {r.recomputed_steps} step(s)"
               if r.recomputed_steps is not None else "")
            + (f" | back at step {r.failed_step} +{_ms(r.caught_up_s)}"
               if r.failed_step is not None else "")
            + f" | total {_ms(r.total_s)}")
    return [head, body]


def format_report(events: list[dict]) -> str:
    recs = recoveries(events)
    if not recs:
        return ""
    if any(isinstance(r, InplaceRecovery) for r in recs):
        lines = ["", "Recovery report (in place: shadows promoted; restart: stop all, "
                 "rendezvous, respawn)"]
    else:
        lines = ["", "Recovery report (restart mode: stop all, rendezvous, respawn, reload "
                 "checkpoint)"]
    for r in recs:
        if isinstance(r, InplaceRecovery):
            lines += _inplace_lines(r)
            continue
        head = (f"  #{r.index} generation {r.generation_from}->"
                f"{r.generation_to if r.generation_to is not None else 'end'}: rank {r.rank} "
                f"{r.how}" + (f" at step {r.failed_step}" if r.failed_step is not None else ""))
        if r.injected:
            head += f"  [injected: {r.injected}]"
        lines.append(head)
        lines.append(
            f"     detection {_ms(r.detect_s)} | group stopped +{_ms(r.stop_s)} | rendezvous "
            f"{_ms(r.rendezvous_s)} | respawned +{_ms(r.spawn_s)} | training resumed "
            f"+{_ms(r.resume_s)}" + (f" at step {r.resumed_step}" if r.resumed_step is not None else "")
            + f" | back at step {r.failed_step} +{_ms(r.caught_up_s)}"
            + (f" | recomputed {r.recomputed_steps} step(s)" if r.recomputed_steps is not None else ""))
    return "\n".join(lines)
