"""One system's run: start its launcher, deliver the scheduled SIGKILLs, wait, tear down.

Role: the only module that starts or signals processes.  Every system gets its kills the same
way, from here: at `offset` seconds after the run's first training step starts (the earliest
`t0` in the step files), SIGKILL the process that last logged a step for the victim rank.  That
is the active trainer under every launcher (a Leto shadow logs no step until it is promoted).
A kill that falls due while the system is not in steady state yet -- the rank is still
recovering from the previous kill (no live trainer has logged a step since), or, under leto-run
in place, the next generation's shadows are not ready yet -- is delivered as soon as it is;
the delay is recorded with the kill.  With `kill_phase="update"` a HOF is aimed instead at the
middle of the victim's next update phase (`update_target`, from its last step record): a
periodic schedule otherwise lands every kill in the same phase, as recoveries cost about the
same each time.

An FF of leto-ckpt (a schedule entry that names a leto-run `--inject` spec, mixed.py) is not
delivered by the harness: leto-run's runtime fires it at its step.  The harness waits for its
`inject` event (its pid and time are the kill's), in schedule order, so a later kill waits for
it as it waits for any recovery; its delay is the event's time minus the scheduled one.

Calling contract: `run_system(argv, env, run_dir, schedule, timeout_s, events_path=...,
nproc=..., kill_phase="any"|"update")` -> `Launch` (`events_path`: leto-run's event log, for shadow readiness).  It never
raises for a failed or timed-out run (the result says so), and leaves no process behind: the
launcher's session is stopped SIGTERM -> grace -> SIGKILL, then any process whose command line
names `run_dir` (trainers, shadows, state managers: torchrun puts workers in sessions of their
own) is SIGKILLed by pid.  KeyboardInterrupt is passed on after the teardown.  `run_dir` is
emptied first: what an earlier run left there is not this run's.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from benchmarks.recovery.mixed import inject_event

POLL_S = 0.02            # how often step files are read: the kill lands within this of its time
TERM_GRACE_S = 10.0      # launcher SIGTERM -> SIGKILL
UPDATE_AT = 0.87         # without phase times: where in a step the middle of its update phase is


@dataclass
class Kill:
    index: int
    rank: int
    offset_s: float              # scheduled: seconds after the first step started
    pid: int | None = None
    t_fault: float | None = None   # time.monotonic() right before os.kill
    delay_s: float | None = None   # t_fault - scheduled time
    skipped: str | None = None     # why it was not delivered
    kind: str = "hof"              # hof | ff (presets.Preset.kinds)
    inject: str | None = None      # leto-run fires it (this spec), the harness only sees it
    aimed_at: float | None = None  # kill_phase="update": the predicted middle of an update phase


@dataclass
class Launch:
    argv: list
    run_dir: str
    exit_code: int | None
    timed_out: bool
    wall_s: float
    t_launch: float
    t_first_step: float | None
    kills: list = field(default_factory=list)
    records: list = field(default_factory=list)   # every JSON line of every steps_<rank>.jsonl
    log_tail: str = ""


class JsonlTail:
    """Incremental reader of JSON-lines files: whole lines only (a line being written waits for
    the next poll).  `files()` names the files to follow; new ones are picked up as they
    appear."""

    def __init__(self, files):
        self.files = files
        self.pos: dict[str, int] = {}
        self.records: list[dict] = []

    def poll(self) -> list[dict]:
        new = []
        for path in self.files():
            try:
                with open(path, "rb") as f:
                    f.seek(self.pos.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self.pos[path] = self.pos.get(path, 0) + end
            for line in data[:end].splitlines():
                if line.strip():
                    new.append(json.loads(line))
        self.records += new
        return new


def step_files(out_dir: str):
    def files():
        try:
            names = sorted(os.listdir(out_dir))
        except OSError:
            return []
        return [os.path.join(out_dir, n) for n in names
                if n.startswith("steps_") and n.endswith(".jsonl")]
    return files


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _victim(records: list[dict], rank: int, killed: set[int], marker: bytes,
            events: list[dict] | None, nproc: int, since: float) -> int | None:
    """The pid of the rank's current trainer, when the system is in steady state again: the
    latest step record's process, if that step started after the previous kill (`since`: a
    survivor of the last failure may live on as a shadow, demoted in process), alive, ours (its
    command line names the run dir: no pid-reuse accident), and, under leto-run in place (`events` given), every
    rank's shadow of the next generation ready.  Why the last: at the paper's MTTF the shadows
    are always ready long before a failure; a compressed schedule must not turn their start-up
    into recovery time (the wait is recorded as the kill's delay)."""
    steps = [r for r in records if r["ev"] == "step" and r["rank"] == rank]
    if not steps:
        return None
    last = max(steps, key=lambda r: r["t1"])
    pid = last["pid"]
    if last["t0"] <= since or pid in killed or not _alive(pid) or marker not in _cmdline(pid):
        return None
    if events is not None:
        ready = {e.get("rank") for e in events
                 if e.get("event") == "shadow_ready" and e.get("generation") == last["gen"] + 1}
        if not all(r in ready for r in range(nproc)):
            return None
    return pid


def _ours(marker: bytes) -> list[int]:
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me and marker in _cmdline(int(d)):
            out.append(int(d))
    return out


def teardown(proc: subprocess.Popen, marker: bytes) -> None:
    """Stop the launcher's session, then SIGKILL whatever of this run is left, by pid."""
    if proc.poll() is None:
        for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    for _ in range(3):                 # a dying agent may still be spawning: look again
        left = _ours(marker)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def update_target(last: dict, now: float) -> float:
    """When the victim's next update phase is half done, predicted from its last step record
    `last` (the next step starts at about last["t1"]): its forward + backward + half its update
    after that, from the record's phase times (train.py --phases), else UPDATE_AT of its
    length.  A time already past moves on by whole steps."""
    dt = last["t1"] - last["t0"]
    ph = last.get("phases") or {}
    if all(k in ph for k in ("fwd", "bwd", "opt")):
        into = ph["fwd"]["s"] + ph["bwd"]["s"] + ph["opt"]["s"] / 2
    else:
        into = UPDATE_AT * dt
    t = last["t1"] + into
    while t < now and dt > 0:
        t += dt
    return t


def _next_kill(kills: list[Kill], t_first: float, records: list[dict], events: list[dict] | None,
               killed: set[int], marker: bytes, nproc: int, progress,
               kill_phase: str = "any") -> None:
    """Deliver (or, for an injected FF, observe) the first pending kill if it is due and the
    system is in steady state; at most one per poll: the next needs new records."""
    k = next((k for k in kills if k.t_fault is None and not k.skipped), None)
    if k is None:
        return
    due = t_first + k.offset_s
    if k.inject is not None:
        # leto-run fires it at its step, possibly before its time (a faster system than the
        # reference): looked for from the start; gen/attempt keep it after the earlier kills.
        ev = inject_event(events or [], k.inject)
        if ev is None:
            return
        k.pid, k.t_fault = ev.get("pid"), ev["mono"]
        k.delay_s = k.t_fault - due
        if progress:
            progress(f"FF (leto-run's {k.inject}) rank {k.rank} pid {k.pid} at "
                     f"+{k.t_fault - t_first:.2f} s (due +{k.offset_s:g} s)")
        return
    if time.monotonic() < due:
        return                                  # kills are in time order
    since = max((x.t_fault for x in kills if x.t_fault is not None), default=-math.inf)
    pid = _victim(records, k.rank, killed, marker, events, nproc, since)
    if pid is None:
        return                                  # still recovering: deliver when it is back
    if kill_phase == "update" and k.kind == "hof":
        last = max((r for r in records if r["ev"] == "step" and r["pid"] == pid),
                   key=lambda r: r["t1"])
        k.aimed_at = update_target(last, time.monotonic())
        time.sleep(max(0.0, k.aimed_at - time.monotonic()))     # at most about one step
    k.pid, k.t_fault = pid, time.monotonic()
    os.kill(pid, signal.SIGKILL)
    killed.add(pid)
    k.delay_s = k.t_fault - due
    if progress:
        progress(f"SIGKILL rank {k.rank} pid {pid} ({k.kind}) at +{k.t_fault - t_first:.2f} s"
                 f" (due +{k.offset_s:g} s)")


def run_system(argv: list[str], env: dict, run_dir: str, schedule: list[tuple[float, int]],
               timeout_s: float, progress=None, events_path: str | None = None,
               nproc: int = 1, kill_phase: str = "any") -> Launch:
    # The directory holds this launch's outputs only: step records or events left by an earlier
    # run in the same --work-dir would be read as this run's (its first step, its victims).
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    log_path = os.path.join(run_dir, "launcher.log")
    marker = os.path.abspath(run_dir).encode() + b"/"
    files = JsonlTail(step_files(os.path.join(run_dir, "steps")))
    events = JsonlTail(lambda: [events_path]) if events_path else None
    kills = [Kill(i, e[1], e[0], kind=e[2] if len(e) > 2 else "hof",
                  inject=e[3] if len(e) > 3 else None) for i, e in enumerate(schedule)]
    killed: set[int] = set()
    t_first = None
    timed_out = False
    with open(log_path, "wb") as log:
        t_launch = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = t_launch + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(POLL_S)
            files.poll()
            if events:
                events.poll()
            steps = [r for r in files.records if r["ev"] == "step"]
            if t_first is None and steps:
                t_first = min(r["t0"] for r in steps)
                if progress:
                    progress(f"training started {t_first - t_launch:.1f} s after launch")
            if t_first is not None:
                _next_kill(kills, t_first, files.records, events.records if events else None,
                           killed, marker, nproc, progress, kill_phase)
        for k in kills:
            if k.t_fault is None and not k.skipped:
                k.skipped = "the run ended first" if not timed_out else "timeout"
    finally:
        teardown(proc, marker)
    files.poll()
    steps = [r for r in files.records if r["ev"] == "step"]
    if t_first is None and steps:        # a run that ended between two polls
        t_first = min(r["t0"] for r in steps)
    code = proc.returncode if not timed_out else None
    return Launch(argv=argv, run_dir=run_dir, exit_code=code, timed_out=timed_out,
                  wall_s=time.monotonic() - t_launch, t_launch=t_launch, t_first_step=t_first,
                  kills=kills, records=files.records, log_tail=_tail(log_path))
