"""Launcher overhead: `leto-run` next to `torchrun`, same options, same worker, same run.

Role: measure what the launcher itself costs on one node, the two numbers the launcher issue
sets goals for (docs/BENCHMARKS.md, "Launcher overhead"):

* **start-up**: launcher start -> every rank executing user code.  The benchmark records
  ``time.monotonic()`` right before ``subprocess.Popen`` of the launcher; each rank records
  ``time.monotonic()`` as the first statement of the worker script (before any import) and
  writes it to a file.  CLOCK_MONOTONIC is one clock for every process of a machine, so the
  difference is meaningful.  Reported: first rank and all ranks (max over ranks).
* **crash detection**: rank 1 is SIGKILLed at t0 (recorded right before ``os.kill``); both
  launchers react to a dead worker by SIGTERMing the survivors, and rank 0's SIGTERM handler
  records ``time.monotonic()`` first thing.  Latency = t_sigterm_at_survivor - t0: it needs
  nothing from the launcher, so it compares the two fairly.  For leto-run the agent's own
  detection time (``failure_detected`` in its ``--events`` JSONL log) is reported next to it.
  The worker never touches torch.distributed (it sleeps), so nothing but the launcher can
  notice the death.

One *trial* is one launch with ``--nproc-per-node 2 --max-restarts 0`` (plus ``--standalone`` by
default; see ``--launcher-args``): its start-up is measured, then rank 1 is killed.  Trials
alternate between the launchers (leto first in even pairs, torchrun first in odd ones) so drift
and order effects cancel; one unreported warm-up trial per launcher fills the page cache first.

Calling contract::

    python benchmarks/launch_overhead.py [--repeats N | --quick] [--json FILE] [--seed S]

stdout gets a Markdown table (median, p10, p90, min per launcher and the leto/torchrun ratio of
medians) and one PASS/MISS line per goal; progress goes to stderr; ``--json`` gets every sample,
the summary, the goals and the machine.  Exit status 0 when every trial produced its numbers
(whatever the goals say), 1 when a trial failed (its launcher log tail is printed), 2 on usage
errors.  No process outlives the benchmark: every launch is torn down in a ``finally``.  The
machine and code description in the report is provenance.py's (benchmarks/recovery uses it too).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Run as a script only benchmarks/ is on sys.path; imported (benchmarks.recovery) the root is.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.provenance import machine_info  # noqa: E402

LETO, TORCHRUN = "leto-run", "torchrun"
MODULES = {LETO: "leto_run", TORCHRUN: "torch.distributed.run"}   # what each script runs
LAUNCHERS = (LETO, TORCHRUN)
NPROC = 2
VICTIM_RANK, SURVIVOR_RANK = 1, 0

# Goals from the launcher issue.  torchrun finds a dead worker by polling exit codes every
# --monitor-interval (0.1 s), i.e. ~50 ms on average; leto-run watches pidfds.
GOAL_DETECT_MS = 10.0
GOAL_STARTUP_RATIO = 1.10

# The worker: written to the trial's temp dir and started by both launchers.  Its first
# statement is the timestamp, so start-up ends where user code begins (no imports before it,
# torch included).  The start file is written only after the SIGTERM handler is installed, so
# it doubles as the "ready" marker: once it exists, a SIGTERM is sure to be timestamped.
WORKER_SOURCE = '''\
import time; T_START = time.monotonic()
import os, signal, sys

out_dir, lifetime = sys.argv[1], float(sys.argv[2])
rank = os.environ["RANK"]


def put(name, text):
    # Write-then-rename: the benchmark polls for these files and must never read half of one.
    tmp = os.path.join(out_dir, "." + name)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out_dir, name))


def on_term(signum, frame):
    t = time.monotonic()          # first: this is the measurement
    put(f"term-{rank}", repr(t))
    os._exit(0)


signal.signal(signal.SIGTERM, on_term)
put(f"start-{rank}", f"{T_START!r} {os.getpid()}")
# No torch.distributed, no peers: only the launcher can notice that a rank died.  The lifetime
# bound means a worker the benchmark failed to clean up still goes away on its own.
deadline = T_START + lifetime
while time.monotonic() < deadline:
    time.sleep(0.05)
'''


@dataclass
class Trial:
    """One launch of one launcher; times in seconds (monotonic differences)."""

    launcher: str
    index: int                       # -1 for the warm-up
    first_rank_s: float              # launcher start -> first rank's first statement
    all_ranks_s: float               # launcher start -> last rank's first statement
    survivor_sigterm_s: float        # kill of rank 1 -> SIGTERM handler runs in rank 0
    agent_detect_s: float | None     # kill -> leto's failure_detected (None for torchrun)
    agent_stop_s: float | None       # kill -> leto's "stop" event, right before its SIGTERMs
    launcher_exit_s: float           # kill -> launcher process exited
    exit_code: int
    settle_s: float                  # pause between "all ranks ready" and the kill


class TrialFailed(RuntimeError):
    pass


# ---- launching ---------------------------------------------------------------------------
def launcher_cmd(name: str) -> list[str]:
    """The launcher's console script next to this interpreter, not the one first on PATH.

    Why: on pyenv machines PATH holds shims (a bash script that execs `pyenv exec`), which add
    the same tens of milliseconds to both launchers and so pull the ratio towards 1.
    """
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(here, os.X_OK):
        return [here]
    found = shutil.which(name)
    # Without an install (a bare machine, PYTHONPATH only) `python -m` runs the same entry point.
    return [found] if found else [sys.executable, "-m", MODULES[name]]


LETO_EXTRA: list[str] = []      # --leto-args: options for leto-run only (e.g. --recovery restart)


def trial_argv(name: str, common: list[str], trial_dir: str, worker: str,
               lifetime_s: float) -> list[str]:
    argv = launcher_cmd(name) + common + ["--log-dir", os.path.join(trial_dir, "logs")]
    if name == LETO:
        argv += ["--events", os.path.join(trial_dir, "events.jsonl")] + LETO_EXTRA
    return argv + [worker, trial_dir, f"{lifetime_s:g}"]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_starts(trial_dir: str) -> dict[int, tuple[float, int]]:
    """{rank: (monotonic time of its first statement, pid)} for the ranks that are ready."""
    starts = {}
    for rank in range(NPROC):
        path = os.path.join(trial_dir, f"start-{rank}")
        if os.path.exists(path):
            t, pid = _read(path).split()
            starts[rank] = (float(t), int(pid))
    return starts


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no launcher log)"


def _is_our_worker(pid: int, worker: str) -> bool:
    # Guards the clean-up kill against pid reuse: only a process running our worker file.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return worker.encode() in f.read()
    except OSError:
        return False


def _teardown(proc: subprocess.Popen, worker_pids: list[int], worker: str) -> None:
    """Stop the launcher (its own session) and any worker of ours that outlived it."""
    if proc.poll() is None:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    # torchrun starts each worker in a new session, so the launcher's group does not reach them.
    for pid in worker_pids:
        if _is_our_worker(pid, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_trial(name: str, index: int, *, common: list[str], work_dir: str, worker: str,
              settle_s: float, timeout_s: float) -> Trial:
    trial_dir = tempfile.mkdtemp(prefix=f"{name}-{index}-", dir=work_dir)
    log_path = os.path.join(trial_dir, "launcher.log")
    # Workers end themselves well after the trial's own timeout (see WORKER_SOURCE).
    argv = trial_argv(name, common, trial_dir, worker, lifetime_s=4 * timeout_s)
    # PET_*/LETO_* would change the options behind our back (the environment is the launchers'
    # second command line); OMP_NUM_THREADS=1 is what both would set, minus their warning.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "LETO_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    starts: dict[int, tuple[float, int]] = {}

    def fail(msg: str) -> TrialFailed:
        return TrialFailed(f"{name} trial {index}: {msg}\n  command: {shlex.join(argv)}\n"
                           f"  launcher log tail:\n{_tail(log_path)}")

    with open(log_path, "wb") as log:
        t_launch = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = t_launch + timeout_s
        while len(starts) < NPROC:
            if proc.poll() is not None:
                raise fail(f"launcher exited ({proc.returncode}) before every rank started")
            if time.monotonic() > deadline:
                raise fail(f"ranks not all started after {timeout_s:g} s")
            # Coarse polling on purpose: the ranks timestamp themselves, so this loop only needs
            # to notice, and should leave the two cores to the launcher.
            time.sleep(0.02)
            starts = _read_starts(trial_dir)
        # The pause lets the launcher settle into steady supervision, and its random length
        # spreads the kill over torchrun's 100 ms polling phase instead of locking onto it.
        time.sleep(settle_s)
        victim_pid = starts[VICTIM_RANK][1]
        t_kill = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise fail(f"launcher still running {timeout_s:g} s after rank {VICTIM_RANK} died")
        t_exit = time.monotonic()
        term_path = os.path.join(trial_dir, f"term-{SURVIVOR_RANK}")
        if not os.path.exists(term_path):
            raise fail(f"rank {SURVIVOR_RANK} was never sent SIGTERM (launcher exit {code})")
        t_term = float(_read(term_path))
        detect = stop = None
        if name == LETO:
            detect, stop = _leto_times(os.path.join(trial_dir, "events.jsonl"), victim_pid)
            if detect is None or stop is None:
                raise fail(f"no failure_detected/stop event for pid {victim_pid} in the log")
            detect, stop = detect - t_kill, stop - t_kill
        t_ranks = [t for t, _ in starts.values()]
        return Trial(launcher=name, index=index, first_rank_s=min(t_ranks) - t_launch,
                     all_ranks_s=max(t_ranks) - t_launch, survivor_sigterm_s=t_term - t_kill,
                     agent_detect_s=detect, agent_stop_s=stop,
                     launcher_exit_s=t_exit - t_kill, exit_code=code, settle_s=settle_s)
    finally:
        _teardown(proc, [pid for _, pid in starts.values()], worker)


def _leto_times(events_path: str, pid: int) -> tuple[float | None, float | None]:
    """(mono of failure_detected for `pid`, mono of the first "stop" after it) from leto's log.

    failure_detected's ``mono`` is when the agent reaped the exit (its pidfd fired); "stop" is
    stamped when the agent starts stopping the group, i.e. just before the survivors' SIGTERM.
    """
    detect = stop = None
    try:
        with open(events_path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("event") == "failure_detected" and rec.get("pid") == pid:
                    detect = float(rec["mono"])
                elif rec.get("event") == "stop" and detect is not None and stop is None:
                    stop = float(rec["mono"])
    except (OSError, ValueError):
        pass
    return detect, stop


# ---- statistics and report ---------------------------------------------------------------
METRICS = (  # (Trial field, row label)
    ("first_rank_s", "start-up: launch -> first rank"),
    ("all_ranks_s", "start-up: launch -> all ranks"),
    ("survivor_sigterm_s", "crash: kill -> survivor SIGTERM"),
    ("agent_detect_s", "crash: kill -> agent failure_detected"),
    ("agent_stop_s", "crash: kill -> agent starts stopping"),
    ("launcher_exit_s", "crash: kill -> launcher exit"),
)


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"n": len(xs), "median": percentile(xs, 50), "p10": percentile(xs, 10),
            "p90": percentile(xs, 90), "min": min(xs), "max": max(xs)}


def summarize(trials: list[Trial]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for field, _ in METRICS:
        per = {name: describe([getattr(t, field) for t in trials
                               if t.launcher == name and t.index >= 0
                               and getattr(t, field) is not None])
               for name in LAUNCHERS}
        a, b = per[LETO], per[TORCHRUN]
        per["ratio"] = a["median"] / b["median"] if a and b and b["median"] > 0 else None
        out[field] = per
    return out


def evaluate_goals(summary: dict[str, dict]) -> list[dict]:
    """PASS/MISS on medians: the goals speak of typical cost, not of the worst sample.  Without
    torchrun's trials (`--only leto-run`) only the agent's own detection is judged; torchrun's
    alone are judged by nothing."""
    if summary["agent_detect_s"][LETO] is None:
        return []
    detect = summary["agent_detect_s"][LETO]["median"] * 1e3
    if summary["survivor_sigterm_s"][TORCHRUN] is None:
        return [{"goal": f"detection <= {GOAL_DETECT_MS:g} ms (agent's failure_detected)",
                 "ok": detect <= GOAL_DETECT_MS, "detail": f"leto-run median {detect:.2f} ms"}]
    react = summary["survivor_sigterm_s"][LETO]["median"] * 1e3
    react_tr = summary["survivor_sigterm_s"][TORCHRUN]["median"] * 1e3
    ratio = summary["all_ranks_s"]["ratio"]
    start_l = summary["all_ranks_s"][LETO]["median"] * 1e3
    start_t = summary["all_ranks_s"][TORCHRUN]["median"] * 1e3
    return [
        {"goal": f"detection <= {GOAL_DETECT_MS:g} ms (agent's failure_detected)",
         "ok": detect <= GOAL_DETECT_MS,
         "detail": f"leto-run median {detect:.2f} ms"},
        {"goal": f"detection <= {GOAL_DETECT_MS:g} ms (stricter: kill -> survivor SIGTERM)",
         "ok": react <= GOAL_DETECT_MS,
         "detail": f"leto-run median {react:.2f} ms vs torchrun {react_tr:.2f} ms "
                   f"({react / react_tr:.2f}x)"},
        {"goal": f"start-up (all ranks) within {100 * (GOAL_STARTUP_RATIO - 1):.0f}% of torchrun",
         "ok": ratio <= GOAL_STARTUP_RATIO,
         "detail": f"leto-run {start_l:.0f} ms vs torchrun {start_t:.0f} ms, ratio {ratio:.3f}"},
    ]


def _ms(d: dict | None, key: str) -> str:
    return "n/a" if d is None else f"{d[key] * 1e3:.1f}"


def render_markdown(summary: dict[str, dict]) -> str:
    cols = ("median", "p10", "p90", "min")
    head = ["metric (ms)"] + [f"{LETO} {c}" for c in cols] + [f"{TORCHRUN} {c}" for c in cols] \
        + ["leto/torchrun"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for field, label in METRICS:
        per = summary[field]
        ratio = "n/a" if per["ratio"] is None else f"{per['ratio']:.2f}"
        cells = [label] + [_ms(per[LETO], c) for c in cols] + [_ms(per[TORCHRUN], c) for c in cols]
        lines.append("| " + " | ".join(cells + [ratio]) + " |")
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None,
                   help="measured trials per launcher (default 10; 2 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke test: 2 repeats, no warm-up")
    p.add_argument("--only", choices=LAUNCHERS,
                   help="run this launcher's trials only (no ratios; the goals that compare "
                        "with torchrun are left out)")
    p.add_argument("--json", metavar="FILE", help="write samples, summary and goals here")
    p.add_argument("--seed", type=int, default=0, help="seed of the pre-kill pauses")
    p.add_argument("--launcher-args", default="--standalone",
                   help="options given to both launchers besides --nproc-per-node 2 "
                        "--max-restarts 0 (default: %(default)s, i.e. c10d on a free port, "
                        "so concurrent runs do not fight over 29500)")
    p.add_argument("--leto-args", default="",
                   help="extra options for leto-run only, e.g. '--recovery restart' (the mode "
                        "without state managers, torchrun's functionality) -- default: none, "
                        "i.e. in-place mode with one state manager per slot")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a launch may take to start all ranks, and to exit after "
                        "the kill (default %(default)s)")
    args = p.parse_args(argv)
    LETO_EXTRA[:] = shlex.split(args.leto_args)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 10
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common = ["--nproc-per-node", str(NPROC), "--max-restarts", "0",
              *shlex.split(args.launcher_args)]
    rng = random.Random(args.seed)
    plan: list[tuple[str, int]] = []
    if not args.quick:
        plan += [(LETO, -1), (TORCHRUN, -1)]
    for i in range(args.repeats):
        plan += [(n, i) for n in (LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1])]
    if args.only:
        plan = [(n, i) for n, i in plan if n == args.only]

    work_dir = tempfile.mkdtemp(prefix="leto-launch-overhead-")
    worker = os.path.join(work_dir, "worker.py")
    with open(worker, "w") as f:
        f.write(WORKER_SOURCE)
    trials: list[Trial] = []
    load_before = os.getloadavg()   # other work on the machine skews absolute times: record it
    try:
        for k, (name, index) in enumerate(plan):
            t = run_trial(name, index, common=common, work_dir=work_dir, worker=worker,
                          settle_s=rng.uniform(0.2, 0.4), timeout_s=args.timeout)
            trials.append(t)
            tag = "warm-up" if index < 0 else f"repeat {index}"
            detect = "" if t.agent_detect_s is None else f" detect {t.agent_detect_s*1e3:.2f} ms"
            print(f"[{k + 1}/{len(plan)}] {name:9s} {tag:9s} all ranks "
                  f"{t.all_ranks_s*1e3:7.1f} ms  survivor SIGTERM "
                  f"{t.survivor_sigterm_s*1e3:6.2f} ms{detect}", file=sys.stderr, flush=True)
    except TrialFailed as e:
        # Keep the launcher logs and event files of a failed run: they are the diagnosis.
        print(f"launch_overhead: {e}\n  trial files kept in {work_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(work_dir, ignore_errors=True)

    load_after = os.getloadavg()
    summary = summarize(trials)
    goals = evaluate_goals(summary)
    machine = machine_info()
    print(f"## Launcher overhead: {LETO} vs {TORCHRUN}, {args.repeats} repeats each "
          f"({machine['nproc']} CPUs, {machine['cpu']}; Python {machine['python']}, "
          f"torch {machine['torch']}; leto at {machine['leto_tree']})\n")
    print(f"Both launched as: `<launcher> {shlex.join(common)} --log-dir DIR worker.py` "
          f"(leto-run also `--events FILE`)\n")
    print(render_markdown(summary) + "\n")
    print(f"Load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, "
          f"after {'/'.join(f'{x:.2f}' for x in load_after)}\n")
    for g in goals:
        print(f"{'PASS' if g['ok'] else 'MISS'}  {g['goal']}: {g['detail']}")
    if args.json:
        report = {"command": [sys.executable, *sys.argv] if argv is None else argv,
                  "launcher_options": common, "repeats": args.repeats, "quick": args.quick,
                  "only": args.only,
                  "seed": args.seed, "machine": machine,
                  "loadavg_before": load_before, "loadavg_after": load_after,
                  "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "summary": summary, "goals": goals,
                  "trials": [asdict(t) for t in trials]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
